"""`python -m pdserve.cli`: the same as the `pdserve` command (used by test harnesses and the process node)."""

from pdserve.cli import main

main()
