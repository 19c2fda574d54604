"""Issue 20, point 1: the renderer speaks vLLM. Every engine container pdserve renders, for every example in
`examples/` and every golden render, parses with the installed vLLM's own argument parser (`vllm serve`'s, not a
copy), and its `--kv-transfer-config` / `--kv-events-config` load into vLLM's own config classes (which forbid
unknown keys); `kv_connector_extra_config` keys must be ones the connector reads. A flag vLLM renames or drops fails
here with argparse's message naming it.

One engine interpreter checks every command line (about 15 s: importing vLLM); no engine starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.api.validation import validate
from pdserve_dev.realvllm import argcheck, service
from pdserve_dev.testing.examples import POLICY
from pdserve_operator.render import render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.name != "invalid.yaml")
GOLDEN = sorted((ROOT / "tests" / "operator" / "render" / "golden").glob("*.yaml"))
pytestmark = [pytest.mark.realvllm, pytest.mark.slow]


def _rendered(path: Path) -> list[dict[str, object]]:
    objects: list[dict[str, object]] = []
    for doc in yaml.safe_load_all(path.read_text()):
        objects += render(validate(doc, POLICY))
    return objects


def _commands() -> list[argcheck.EngineCommand]:
    commands: list[argcheck.EngineCommand] = []
    for example in EXAMPLES:
        commands += argcheck.engine_commands(_rendered(example), f"examples/{example.name}")
    for golden in GOLDEN:
        commands += argcheck.engine_commands(list(yaml.safe_load_all(golden.read_text())), f"golden/{golden.name}")
    tier = service.manifest("real", "default")
    commands += argcheck.engine_commands(render(validate(tier, POLICY)), "the realvllm tier's PDService")
    return commands


COMMANDS = _commands()
# The checker's own proof that it can fail: vLLM must refuse these, naming what is wrong.
NOT_VLLM = [
    ("an unknown flag", ["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
    ("an unknown kv-transfer-config key", ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_rol":"x"}'],
     "kv_rol"),
    ("an unknown kv-events-config key", ["--kv-events-config", '{"enable_kv_cache_events":true,"publishr":"zmq"}'],
     "publishr"),
]  # fmt: skip


@pytest.fixture(scope="module")
def verdicts(real_vllm: Path) -> dict[str, argcheck.Verdict]:
    base = COMMANDS[0].argv
    probes = [argcheck.EngineCommand(f"probe: {what}", base + extra) for what, extra, _ in NOT_VLLM]
    events = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}'
    probes.append(argcheck.EngineCommand("probe: kv events", [*base, "--kv-events-config", events]))
    return {verdict.where: verdict for verdict in argcheck.check(COMMANDS + probes)}


def test_every_example_and_golden_render_has_engine_containers() -> None:
    sources = {command.where.split(":")[0] for command in COMMANDS}
    expected = {f"examples/{p.name}" for p in EXAMPLES} | {f"golden/{p.name}" for p in GOLDEN}
    assert expected <= sources, f"no vllm container found in {sorted(expected - sources)}"
    assert len(GOLDEN) >= len(EXAMPLES) > 0


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_engine_command_line_parses_with_vllm(
    command: argcheck.EngineCommand, verdicts: dict[str, argcheck.Verdict]
) -> None:
    verdict = verdicts[command.where]
    assert verdict.ok, f"{command.where}: vLLM refuses the rendered command line: {verdict.errors}"
    parsed = verdict.parsed
    # What vLLM understood is what the renderer meant.
    role = "kv_producer" if "-prefill " in command.where else "kv_consumer"
    assert parsed["kv_connector"] == "NixlConnector" and parsed["kv_role"] == role, parsed
    assert str(parsed["block_size"]) == command.argv[command.argv.index("--block-size") + 1], parsed
    assert parsed["port"] == int(command.argv[command.argv.index("--port") + 1]), parsed


@pytest.mark.parametrize(("what", "extra", "named"), NOT_VLLM, ids=[w for w, _, _ in NOT_VLLM])
def test_the_check_fails_naming_what_vllm_refuses(
    what: str, extra: list[str], named: str, verdicts: dict[str, argcheck.Verdict]
) -> None:
    verdict = verdicts[f"probe: {what}"]
    assert not verdict.ok and named in " ".join(verdict.errors), verdict


def test_kv_events_config_loads_into_vllm_class(verdicts: dict[str, argcheck.Verdict]) -> None:
    verdict = verdicts["probe: kv events"]
    assert verdict.ok and verdict.parsed["kv_events"] is True, verdict
