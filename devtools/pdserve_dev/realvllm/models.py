"""The tiny models real vLLM serves in tests, built once into a Hugging Face cache folder and reused.

No model can be downloaded, so `build_model.py` (run by the engine's interpreter) makes a seeded random Llama and a
locally trained tokenizer. They land in ``<cache>/vllm-cpu/models/<key>/hf/hub/models--pdserve--tiny-llama/...``
(the hub's cache layout), so an engine started with ``HF_HOME`` there and ``HF_HUB_OFFLINE=1`` serves
``pdserve/tiny-llama`` as if downloaded: a PDService's ``model.uri: hf://pdserve/tiny-llama`` works unchanged. The
key hashes the builder and the engine's pins; a folder is complete once its ``.built`` file exists (built in a
temporary folder, then renamed), so concurrent sessions and interrupted builds never see half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve_dev.realvllm import install

REPO_ID = "pdserve/tiny-llama"
#: The served name tests and examples use (`model.name`).
MODEL_NAME = "tiny-llama"
#: A fixed revision: the hub layout needs one, and `refs/main` names it.
REVISION = "7a11e1f0000000000000000000000000000c0de1"
BUILDER = Path(__file__).with_name("build_model.py")


class ModelBuildError(RuntimeError):
    """The builder failed; the message has its last lines."""


def _key() -> str:
    digest = hashlib.sha256(BUILDER.read_bytes() + install.cache_key().encode() + REVISION.encode())
    return digest.hexdigest()[:12]


def hf_home() -> Path:
    """The HF_HOME holding the tiny models of the current builder and pins."""
    return install.home() / "models" / _key() / "hf"


def snapshot() -> Path:
    """The model's folder (config, weights, tokenizer) inside the cache."""
    owner, name = REPO_ID.split("/")
    return hf_home() / "hub" / f"models--{owner}--{name}" / "snapshots" / REVISION


def ensure_models() -> Path:
    """Build the tiny model unless it is there already (about 10 s); returns HF_HOME."""
    target = hf_home()
    if (target.parent / ".built").exists():
        return target
    if not install.installed():
        raise ModelBuildError(install.missing_message())
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent.parent))
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(scratch / "hf")}
        proc = subprocess.run(
            [str(install.engine_python()), str(BUILDER), str(scratch / "hf"), REPO_ID, REVISION],
            capture_output=True, text=True, timeout=600, check=False, env=env,
        )  # fmt: skip
        if proc.returncode != 0:
            raise ModelBuildError(f"building {REPO_ID} failed:\n{proc.stderr[-3000:]}")
        (scratch / ".built").write_text(json.dumps({"repo": REPO_ID, "revision": REVISION}))
        try:
            scratch.rename(target.parent)
        except OSError:
            if not (target.parent / ".built").exists():  # not another session's finished build: a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # World-readable, as a model baked into an image is: non-root engines (tests/realvllm) read it too.
    for folder, _, files in os.walk(target.parent):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    return target
