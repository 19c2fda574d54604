"""The production distribution: what `pip install pdserve` and the image get, and what they must not.

The wheel is built offline from this checkout (`--no-build-isolation`: the test session has no network) and read
as a zip: the local cluster, the process node and the test helpers (the `pdserve-dev` distribution) and
`cryptography` must not be in it; the operator, the router, the simulator and the CLI must.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import yaml

from pdserve.api.validation import validate

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (path,) = out.glob("pdserve-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_the_product(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for module in (
        "pdserve/cli/__init__.py",
        "pdserve/api/v1alpha1.py",
        "pdserve_operator/reconcile.py",
        "pdserve_runtime/router/proxy.py",
        "pdserve_sim/server.py",
    ):
        assert module in names


def test_the_wheel_holds_no_development_tooling(wheel: zipfile.ZipFile) -> None:
    dev = [name for name in wheel.namelist() if name.startswith("pdserve_dev/") or "devcluster" in name]
    cluster_files = [name for name in wheel.namelist() if name.endswith(("go.sum", ".tmpl", "kwok-stages.yaml"))]
    testing = [name for name in wheel.namelist() if name.rsplit("/", 1)[-1] in {"testing.py", "harness.py"}]
    assert dev == [] and cluster_files == [] and testing == []


def test_the_wheel_does_not_pull_cryptography(wheel: zipfile.ZipFile) -> None:
    (metadata_name,) = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    base = [req for req in metadata.get_all("Requires-Dist") or [] if "extra ==" not in req]
    assert base, "the base distribution has dependencies"
    assert not [req for req in base if req.lower().startswith("cryptography")]


def test_the_image_copies_no_development_tooling() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "--from" not in line]
    assert "devtools" not in copied and "tests" not in copied
    assert {"pdserve", "operator", "runtime", "sim"} <= set(copied)


def test_the_image_holds_the_picker_relay_the_picker_pod_runs() -> None:
    from pdserve_dev.testing.examples import POLICY
    from pdserve_operator.render import render

    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY runtime/picker-relay ./" in dockerfile
    assert "COPY --from=relay /out/pdserve-picker-relay /usr/local/bin/pdserve-picker-relay" in dockerfile
    document = yaml.safe_load((ROOT / "examples" / "gateway" / "pdservice.yaml").read_text())
    deployment = next(o for o in render(validate(document, POLICY)) if o["kind"] == "Deployment")
    commands = [c["command"][0] for c in deployment["spec"]["template"]["spec"]["containers"]]
    assert "pdserve-picker-relay" in commands
