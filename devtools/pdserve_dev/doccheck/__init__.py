"""Checks that the documentation cannot drift from the code: every command it shows parses against the real command
line, every link and repository path it names exists, every manifest it shows is accepted.

The README and `docs/*.md` show commands in fenced shell blocks and in inline code spans. `markdown` finds them (and
the links, headings and YAML blocks) with their line numbers, `shell` splits a block into the commands a shell would
run, and one checker per program says what is wrong with each:

- `clicommand`: `pdserve ...` is parsed by the real click command tree (an unknown subcommand or option, a bad
  choice, a missing value: click's own error), and the offline subcommands are run;
- `cobra`: `kubectl ...` and `helm ...` name only subcommands and flags their own `--help` lists;
- `programs`: the benchmarks' options against their `--help`, the scripts, pip's extras.

A problem is one line, `FILE:LINE: what is wrong`, so a failing test names the page and the line to fix.
"""
