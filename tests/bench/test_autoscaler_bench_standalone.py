"""The repository stands alone: the autoscaler benchmark runs from a copy of the repository with nothing beside it.

The Azure traces it replays ship in `bench/traces` (gzipped, with their CC-BY attribution). The benchmark runs
here as a user runs it, `bench/autoscaler_bench.py --quick --duration 60` (the quick run cut to its first minute of
trace, which loads both scenarios' traces the way the full run does), from a copy of the repository's files in an
otherwise empty folder, importing the copy's packages. An audit hook (`sys.addaudithook`) records every file the
benchmark opens: none may lie outside the copy and the Python installation.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "bench" / "traces"
#: SHA-256 of the published CSVs (bench/traces/README.md lists them): the shipped files are those, compressed.
PUBLISHED = {
    "azure-llm-2023-conv.csv.gz": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    "azure-llm-2023-code.csv.gz": "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
}
#: Import roots of the repository's packages (pyproject's setuptools `where` and the dev distribution).
PACKAGE_ROOTS = (".", "operator", "runtime", "sim", "devtools")

# Runs the benchmark with an audit hook that notes every opened path outside the allowed roots, and writes them to
# the file named by the first argument when the benchmark is done.
WRAPPER = """
import json, os, runpy, sys
report, script, *args = sys.argv[1:]
allowed = [os.path.realpath(p) for p in (os.getcwd(), sys.prefix, sys.base_prefix, sys.exec_prefix, '/dev', '/proc')]
outside = set()

def hook(event, payload):
    if event == 'open' and isinstance(payload[0], (str, bytes)):
        path = os.path.realpath(os.fsdecode(payload[0]))
        if not any(path == root or path.startswith(root + os.sep) for root in allowed):
            outside.add(path)

sys.addaudithook(hook)
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name='__main__')
except SystemExit as exc:
    code = exc.code
else:
    code = 0
with open(report, 'w') as handle:
    json.dump(sorted(outside), handle)
sys.exit(code)
"""


def test_the_shipped_traces_are_the_published_files_and_credit_their_authors() -> None:
    for name, digest in PUBLISHED.items():
        assert hashlib.sha256(gzip.decompress((TRACES / name).read_bytes())).hexdigest() == digest, name
    readme = (TRACES / "README.md").read_text()
    assert "CC BY 4.0" in readme and "creativecommons.org/licenses/by/4.0" in readme
    assert "Splitwise" in readme and all(digest in readme for digest in PUBLISHED.values())


def _copy_of_the_repository(target: Path) -> None:
    """The files a clone has (tracked, plus new files git does not ignore), and nothing else."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    for relative in filter(None, listed.split("\0")):
        source = ROOT / relative
        if source.is_file():  # a file deleted in the work tree but still tracked is not in a clone of it either
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / relative)


@pytest.mark.slow
def test_the_autoscaler_bench_runs_from_a_copy_with_nothing_beside_it(tmp_path: Path) -> None:
    copy = tmp_path / "pdserve"
    _copy_of_the_repository(copy)
    assert [p.name for p in tmp_path.iterdir()] == ["pdserve"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(copy / root) for root in PACKAGE_ROOTS)}
    # The copy's packages are imported, not the checkout's (which the venv's editable install points at).
    show = "import pdserve_dev.replay.trace as t, pdserve_operator as o; print(t.__file__, o.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", show],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert all(Path(path).is_relative_to(copy) for path in where), where

    report, results = copy / "opened-outside.json", copy / "smoke.json"
    bench = ["bench/autoscaler_bench.py", "--quick", "--duration", "60", "--json", str(results)]
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(report), *bench],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "floor not judged" in proc.stdout
    assert json.loads(report.read_text()) == []
    document = json.loads(results.read_text())
    scenarios = {s["name"]: s for s in document["scenarios"]}
    assert set(scenarios) == {"chat", "synthetic"}
    assert scenarios["chat"]["trace"] == "azure-llm-2023-conv.csv" and scenarios["chat"]["requests"] > 1000
    assert [p["name"] for p in scenarios["chat"]["policies"]] == [
        "static-peak",
        "hpa-style",
        "llm-d-slo",
        "dynamo-planner",
        "pdserve",
        "pdserve-threshold",
        "pdserve-on-arrival",
    ]
    assert all(p["shed"] >= 0 and p["ttft_p99_s"] >= p["ttft_p90_s"] for p in scenarios["chat"]["policies"])
    # Every policy reports the PD threshold over time; only pdserve-threshold may move it off the configured value.
    thresholds = {p["name"]: p["threshold"] for p in scenarios["chat"]["policies"]}
    fixed = [t for name, t in thresholds.items() if name != "pdserve-threshold"]
    assert all(t["min"] == t["max"] and t["changes"] == 0 for t in fixed), thresholds
    assert thresholds["pdserve-threshold"]["min"] <= thresholds["pdserve-threshold"]["mean"]
    assert scenarios["synthetic"]["requests"] > 1000
