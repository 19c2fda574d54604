"""The documentation checks (`pdserve_dev.doccheck`) find what drifted: each rule on its own, then a page broken
in every way the checks know, against the real `pdserve` command tree and the real kubectl and helm."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from pdserve.cli import main as pdserve_cli
from pdserve_dev.cluster import build
from pdserve_dev.doccheck import clicommand, markdown, shell
from pdserve_dev.doccheck.cobra import CobraProgram, parse_help
from pdserve_dev.doccheck.pages import PageChecker, Tools
from pdserve_dev.doccheck.programs import Programs
from pdserve_dev.testing.helm import helm

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------------------------ markdown


def test_fences_spans_links_and_anchors_carry_their_lines() -> None:
    text = "\n".join(
        [
            "# Title",  # 1
            "",
            "Run `pdserve validate",  # 3: a span over a line break
            "-f FILE` and see [the API](api.md#status), not `[a](b.md)`.",
            "",
            "```bash",  # 6
            "pdserve crd",  # 7
            "[x](inside-a-fence.md)",
            "```",
            "",
            "| a | `build\\|up` |",  # 11: a table cell's escaped pipe
            "",
            "## Title",  # 13: a repeated heading gets -1
            "## `pdserve sim` (the simulator): v1.2",
            "```",  # 15: no language
            "text",
            "```",
            "[ref]: ../README.md",  # 18
        ]
    )
    page = markdown.parse(Path("page.md"), text)
    assert [(f.line, f.language, f.lines) for f in page.fences] == [
        (7, "bash", ("pdserve crd", "[x](inside-a-fence.md)")),
        (16, "", ("text",)),
    ]
    assert [(s.line, s.text) for s in page.spans] == [
        (3, "pdserve validate -f FILE"),
        (4, "[a](b.md)"),
        (11, "build|up"),
        (14, "pdserve sim"),
    ]
    assert [(link.line, link.target) for link in page.links] == [(4, "api.md#status"), (18, "../README.md")]
    assert page.anchors == {"title", "title-1", "pdserve-sim-the-simulator-v12"}


def test_a_fence_left_open_is_reported() -> None:
    assert markdown.parse(Path("p.md"), "a\n```bash\npdserve crd\n").unclosed_fence == 2


def test_heading_anchors_follow_github() -> None:
    assert markdown.slug("Chaos: nothing lost under faults (`bench/chaos.py`)") == (
        "chaos-nothing-lost-under-faults-benchchaospy"
    )
    assert markdown.slug("The loop: collector -> model -> policy") == "the-loop-collector---model---policy"
    assert markdown.slug("Monitoring (off by default)") == "monitoring-off-by-default"


# --------------------------------------------------------------------------------------------------------- shell


def test_a_block_splits_into_the_commands_a_shell_runs() -> None:
    lines = [
        "helm install pdserve charts/pdserve \\",  # 10
        "  -n pdserve-system   # exits 1 when it is there",
        "",
        "cat examples/minimal.yaml | pdserve render -f - > /tmp/out.yaml && echo done",  # 13
        'kubectl patch x -p \'{"a":',  # 14: a quote over a line break
        "1}'",
        "A=1 sudo pdserve crd; pdserve validate -f x.yaml",  # 16
    ]
    found = [(c.line, c.argv, c.expected_exit, c.stdin_redirected) for c in shell.commands(lines, first_line=10)]
    assert found == [
        (10, ("helm", "install", "pdserve", "charts/pdserve", "-n", "pdserve-system"), 1, False),
        (13, ("cat", "examples/minimal.yaml"), 0, False),
        (13, ("pdserve", "render", "-f", "-"), 0, True),
        (13, ("echo", "done"), 0, False),
        (14, ("kubectl", "patch", "x", "-p", '{"a":\n1}'), 0, False),
        (16, ("pdserve", "crd"), 0, False),
        (16, ("pdserve", "validate", "-f", "x.yaml"), 0, False),
    ]


def test_a_console_block_runs_only_its_prompted_lines() -> None:
    found = [c.argv for c in shell.commands(["$ pdserve crd", "apiVersion: v1", "$ kubectl get pds"], console=True)]
    assert found == [("pdserve", "crd"), ("kubectl", "get", "pds")]


def test_an_unclosed_quote_is_an_error_at_its_line() -> None:
    with pytest.raises(shell.ShellSyntaxError) as caught:
        list(shell.commands(["pdserve crd", "echo 'open"], first_line=5))
    assert caught.value.line == 6


@pytest.mark.parametrize(
    ("word", "placeholder"),
    [("FILE", True), ("NAME-router", True), ("pds/NAME", True), ("<version>", True), ("...", True), ("N", True)],
)
def test_placeholders_are_the_readers_values(word: str, placeholder: bool) -> None:
    assert shell.is_placeholder(word) is placeholder


@pytest.mark.parametrize("word", ["pdserve-system", "examples/minimal.yaml", "-A", "hf://Qwen/Qwen2.5-7B-Instruct"])
def test_real_values_are_not_placeholders(word: str) -> None:
    assert not shell.is_placeholder(word)


# --------------------------------------------------------------------------------------------- the pdserve CLI


@pytest.mark.parametrize(
    "args",
    [
        ["crd"],
        ["render", "-f", "examples/minimal.yaml", "--allow-model-host-paths", "/mnt/models"],
        ["operator", "--prometheus-url", "http://prometheus:9090", "--all-namespaces"],
        ["router", "--port", "8080", "--prefill", "http://a:8000", "--decode", "http://b:8000"],
        ["sim", "--role", "decode", "--fast"],
        ["sim", "serve", "some/model", "--kv-transfer-config", "{}"],
        ["dev", "cluster", "up", "--prometheus"],
        ["dev", "cluster", "kubectl", "get", "nodes"],
        ["validate", "--help"],
    ],
)
def test_real_command_lines_parse(args: list[str]) -> None:
    assert clicommand.check(pdserve_cli, args, complete=True) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["render", "-f", "x.yaml", "--no-such-flag"], "No such option '--no-such-flag'"),
        (["renderr", "-f", "x.yaml"], "has no subcommand 'renderr'"),
        (["dev", "cluster", "upp"], "has no subcommand 'upp'"),
        (["render"], "Missing option '-f'"),
        (["render", "-f"], "Option '-f' requires an argument"),
        (["operator", "--log-format", "yaml"], "'yaml' is not one of"),
        (["crd", "extra"], "unexpected extra argument"),
        (["dev", "cluster"], "needs a subcommand"),
    ],
)
def test_a_command_line_that_drifted_fails_with_clicks_own_error(args: list[str], message: str) -> None:
    problems = clicommand.check(pdserve_cli, args, complete=True)
    assert len(problems) == 1 and message in problems[0], problems


def test_prose_may_leave_values_to_the_reader() -> None:
    """An inline span names a command loosely: placeholders, alternatives, a required option left out."""
    for args in (
        ["render"],
        ["dev", "cluster", "build|up|down|status|kubeconfig"],
        ["render", "--max-input-bytes", "N"],
    ):
        assert clicommand.check(pdserve_cli, args, complete=False) == [], args
    # ... but never an option that does not exist, nor one wrong alternative.
    assert clicommand.check(pdserve_cli, ["render", "--no-such-flag"], complete=False)
    assert clicommand.check(pdserve_cli, ["dev", "cluster", "up|sideways"], complete=False)


# ------------------------------------------------------------------------------------------------ kubectl, helm

HELM_HELP = """Usage:
  helm install [NAME] [CHART] [flags]

Flags:
      --atomic                                    if set, the installation process deletes the installation
      --create-namespace                          create the release namespace if not present
  -f, --values strings                            specify values in a YAML file or a URL (can specify multiple)
  -h, --help                                      help for install

Global Flags:
  -n, --namespace string            namespace scope for this request
"""

KUBECTL_HELP = """Basic Commands (Beginner):
  create          Create a resource from a file or from stdin
  get             Display one or many resources

Options:
    --all=false:
\tSelect all resources.

    -o, --output='':
\tOutput format.
"""


def test_both_help_formats_give_flags_and_whether_they_take_a_value() -> None:
    helm_help = parse_help(HELM_HELP)
    assert helm_help.flags.long == {
        "atomic": False,
        "create-namespace": False,
        "values": True,
        "help": False,
        "namespace": True,
    }
    assert helm_help.flags.short == {"f": "values", "h": "help", "n": "namespace"}
    kubectl_help = parse_help(KUBECTL_HELP)
    assert kubectl_help.commands == {"create", "get"}
    assert kubectl_help.flags.long == {"all": False, "output": True}


@pytest.fixture(scope="module")
def kubectl() -> CobraProgram:
    return CobraProgram("kubectl", build.ensure_binaries(("kubectl",)) / "kubectl", global_help=["options"])


@pytest.fixture(scope="module")
def helm_program() -> CobraProgram:
    return CobraProgram("helm", build.ensure_binaries(("helm",)) / "helm")


@pytest.mark.parametrize(
    "args",
    [
        ["get", "pds", "-o", "wide"],
        ["-n", "argocd", "get", "pods", "-A"],
        ["wait", "--for=condition=Ready", "pds/qwen", "--timeout=15m"],
        ["auth", "can-i", "--list", "--as", "system:serviceaccount:x:y"],
        ["apply", "--server-side", "-f", "crds/pdservice.yaml"],
        ["logs", "deploy/x", "--previous", "-n", "pdserve-system"],
    ],
)
def test_kubectl_lines_that_exist(kubectl: CobraProgram, args: list[str]) -> None:
    assert kubectl.check(args) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["get", "pds", "--no-such-flag"], "`kubectl get` has no flag --no-such-flag"),
        (["auth", "can-i", "--lists"], "`kubectl auth can-i` has no flag --lists"),
        (["get", "pds", "-Q"], "`kubectl get` has no flag -Q"),
        (["wait", "--timeoutt=1m", "pds/x"], "`kubectl wait` has no flag --timeoutt"),
    ],
)
def test_kubectl_flags_that_do_not(kubectl: CobraProgram, args: list[str], message: str) -> None:
    assert kubectl.check(args) == [message]


def test_helm_flags(helm_program: CobraProgram) -> None:
    ok = ["install", "pdserve", "charts/pdserve", "-n", "pdserve-system", "--create-namespace", "--set", "a=b"]
    assert helm_program.check(ok) == []
    assert helm_program.check(["upgrade", "x", "y", "--reuse-values", "--set-json", "a=1"]) == []
    assert helm_program.check(["install", "x", "y", "--create-namespaces"]) == [
        "`helm install` has no flag --create-namespaces"
    ]


# --------------------------------------------------------------------------------------------- a broken page


def _helm_run(args: Sequence[str]) -> tuple[int, str]:
    proc = helm(*args, check=False)
    return proc.returncode, proc.stderr


@pytest.fixture
def site(tmp_path: Path, kubectl: CobraProgram, helm_program: CobraProgram) -> Path:
    """A repository root of its own for the broken page: the example fragments merge into, the chart, pyproject."""
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "minimal.yaml", tmp_path / "examples")
    shutil.copytree(ROOT / "charts", tmp_path / "charts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for program in ("bench/chaos.py", "scripts/test.sh"):
        (tmp_path / program).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / program, tmp_path / program)  # keeps the executable bit
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# There\n\n## A section\n")
    return tmp_path


def _checker(site: Path, kubectl: CobraProgram, helm_program: CobraProgram) -> PageChecker:
    tools = Tools(
        cli=pdserve_cli,
        kubectl=kubectl,
        helm=helm_program,
        helm_run=_helm_run,
        programs=Programs(site, vllm_flags=ROOT / "tests" / "api" / "data" / "vllm-0.32-serve-flags.txt"),
    )
    return PageChecker(site, tools)


BROKEN = """# A page that drifted

```bash
pdserve render -f examples/minimal.yaml --no-such-flag
pdserve validate -f examples/minimal.yaml     # exits 1
helm install pdserve charts/pdserve --set no.such.value=1
kubectl wait --for=condition=Ready pds/qwen --timeoutt=15m
kubectl apply -f examples/gone.yaml
frobnicate --all
.venv/bin/python bench/chaos.py --quickk
./scripts/test.sh -m "not clusterr"
.venv/bin/pip install -e '.[benchh]'
```

Inline: `pdserve operator --prometheus-urll URL` and `vllm serve m --max-model-lenn 4`.

```yaml
apiVersion: pdserve.io/v1alpha1
kind: PDService
metadata: {name: x}
spec:
  model: {name: m, uri: hf://a/b, revisoin: main}
  engine: {image: vllm/vllm-openai:v0.32.0}
```

```yaml
spec:
  prefill:
    autoscaling: {enabled: true, minReplicas: 3, maxReplicas: 2}
```

Links: [gone](gone.md), [no heading](there.md#no-such-heading), [fine](there.md#a-section).
Paths: `examples/gone.yaml`, `examples/minimal.yaml`.

```
an unlabelled fence
```
"""


def test_a_broken_page_fails_every_check_with_its_line(
    site: Path, kubectl: CobraProgram, helm_program: CobraProgram, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(site)
    page = site / "docs" / "broken.md"
    page.write_text(BROKEN)
    problems = _checker(site, kubectl, helm_program).all(page)
    expected = [
        ("docs/broken.md:35:", "a fence without a language"),
        ("docs/broken.md:4:", "No such option '--no-such-flag'"),
        ("docs/broken.md:5:", "exited 0, not 1"),
        (
            "docs/broken.md:6:",
            "`helm template` of `helm install pdserve charts/pdserve --set no.such.value=1` exited 1",
        ),
        ("docs/broken.md:7:", "`kubectl wait` has no flag --timeoutt"),
        ("docs/broken.md:8:", "`kubectl`: no file examples/gone.yaml"),
        ("docs/broken.md:9:", "no check for the program 'frobnicate'"),
        ("docs/broken.md:10:", "`bench/chaos.py` has no option --quickk"),
        ("docs/broken.md:11:", "no pytest marker 'clusterr'"),
        ("docs/broken.md:12:", "no extra [benchh] in pyproject.toml"),
        ("docs/broken.md:15:", "No such option '--prometheus-urll'"),
        ("docs/broken.md:15:", "`vllm serve` has no flag --max-model-lenn"),
        ("docs/broken.md:18:", "spec.model.revisoin"),
        ("docs/broken.md:27:", "PDService fragment"),
        ("docs/broken.md:32:", "link gone.md: no such file"),
        ("docs/broken.md:32:", "link there.md#no-such-heading: docs/there.md has no heading #no-such-heading"),
        ("docs/broken.md:33:", "`examples/gone.yaml` is not in the repository"),
    ]
    for where, what in expected:
        assert any(p.startswith(where) and what in p for p in problems), (where, what, problems)
    assert len(problems) == len(expected), "\n".join(problems)


def test_a_page_that_holds_only_what_works_passes(
    site: Path, kubectl: CobraProgram, helm_program: CobraProgram, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(site)
    page = site / "docs" / "fine.md"
    page.write_text(
        "# Fine\n\n```bash\npdserve validate -f examples/minimal.yaml\n.venv/bin/python bench/chaos.py --quick\n"
        "./scripts/test.sh -m 'not cluster'\n"
        "helm install pdserve charts/pdserve -n pdserve-system --create-namespace --set watch.mode=namespaced "
        "--set 'watch.namespaces={serving}'\n```\n\nSee [there](there.md#a-section) and `examples/minimal.yaml`.\n"
    )
    assert _checker(site, kubectl, helm_program).all(page) == []
