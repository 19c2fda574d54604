"""Issue 20, point 1: the renderer speaks vLLM. Every engine container pdserve renders, for every example in
`examples/` and every golden render, parses with the installed vLLM's own argument parser (`vllm serve`'s, not a
copy), and its `--kv-transfer-config` / `--kv-events-config` load into vLLM's own config classes (which forbid
unknown keys); a MultiConnector's children are built by vLLM's own MultiConnector code, as the engine builds them at
start-up; `kv_connector_extra_config` keys, of every connector and child, must be ones vLLM reads. A flag vLLM renames
or drops fails here with argparse's message naming it.

One engine interpreter checks every command line (about 15 s: importing vLLM); no engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    # What the renderer once emitted for a KV store: vLLM 0.32's MultiConnector passes the outer engine_id to each
    # child beside the child's own keys, so a child's engine_id kills the engine at start-up.
    ("a MultiConnector child with its own engine_id", ["--kv-transfer-config", json.dumps({
        "kv_connector": "MultiConnector", "kv_role": "kv_producer", "engine_id": "e",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "e"}]}})],
     "multiple values for keyword argument 'engine_id'"),
    ("an unknown key of a MultiConnector child", ["--kv-transfer-config", json.dumps({
        "kv_connector": "MultiConnector", "kv_role": "kv_producer", "engine_id": "e",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
            {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"cpu_bytes": 1}}]}})],
     "'cpu_bytes' is read nowhere in OffloadingConnector's code"),
]  # fmt: skip


@pytest.fixture(scope="module")
def verdicts(real_vllm: Path) -> dict[str, argcheck.Verdict]:
    # The probes extend one plain command line (the tier's prefill engine: NIXL alone), without its own KV events
    # flag, so each probe's verdict is about what it adds.
    base = next(c.argv for c in COMMANDS if c.where.startswith("the realvllm tier's") and "-prefill " in c.where)
    if "--kv-events-config" in base:
        flag = base.index("--kv-events-config")
        base = base[:flag] + base[flag + 2 :]
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
    assert parsed["kv_connector"] in ("NixlConnector", "MultiConnector") and parsed["kv_role"] == role, parsed
    # NIXL is the engine's first connector (alone, or a MultiConnector's first child), with the pool's role, and every
    # connector the engine builds carries the pod incarnation's engine id.
    nixl, *tiers = parsed["connectors"]
    assert (nixl["kv_connector"], nixl["kv_role"]) == ("NixlConnector", role), parsed
    assert {c["engine_id"] for c in parsed["connectors"]} == {"$(POD_NAME)-$(POD_UID)"}, parsed
    rendered_transfer = _flag_json(command, "--kv-transfer-config")
    rendered_children = rendered_transfer["kv_connector_extra_config"].get("connectors", [])
    assert [c["kv_connector"] for c in tiers] == [c["kv_connector"] for c in rendered_children[1:]], parsed
    assert str(parsed["block_size"]) == command.argv[command.argv.index("--block-size") + 1], parsed
    assert parsed["port"] == int(command.argv[command.argv.index("--port") + 1]), parsed
    if "--kv-events-config" in command.argv:
        rendered = _flag_json(command, "--kv-events-config")
        assert parsed["kv_events_config"] == {**parsed["kv_events_config"], **rendered}, parsed


def _flag_json(command: argcheck.EngineCommand, flag: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(command.argv[command.argv.index(flag) + 1])
    return loaded


def test_the_renders_cover_kv_events_and_multiconnector() -> None:
    """The check covers what the renderer emits: KV events and a MultiConnector of every tier appear in a render."""
    events = [c for c in COMMANDS if "--kv-events-config" in c.argv]
    multi = [c for c in COMMANDS if '"MultiConnector"' in " ".join(c.argv)]
    assert events and multi, (len(events), len(multi))
    children = {
        child["kv_connector"]
        for command in multi
        for child in _flag_json(command, "--kv-transfer-config")["kv_connector_extra_config"]["connectors"]
    }
    assert children == {"NixlConnector", "OffloadingConnector", "MooncakeStoreConnector"}, children


@pytest.mark.parametrize(("what", "extra", "named"), NOT_VLLM, ids=[w for w, _, _ in NOT_VLLM])
def test_the_check_fails_naming_what_vllm_refuses(
    what: str, extra: list[str], named: str, verdicts: dict[str, argcheck.Verdict]
) -> None:
    verdict = verdicts[f"probe: {what}"]
    assert not verdict.ok and named in " ".join(verdict.errors), verdict


def test_kv_events_config_loads_into_vllm_class(verdicts: dict[str, argcheck.Verdict]) -> None:
    verdict = verdicts["probe: kv events"]
    assert verdict.ok and verdict.parsed["kv_events"] is True, verdict
