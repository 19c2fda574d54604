"""Regenerates `ext_proc_pb2.py` and `ext_proc_pb2.pyi` from `ext_proc.proto` (needs grpcio-tools, a dev dependency).

The generated module is checked in so that the product needs only the protobuf runtime, not a compiler.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUTS = ("ext_proc_pb2.py", "ext_proc_pb2.pyi")


def generate(out_dir: Path) -> None:
    """Compile ext_proc.proto into `out_dir` (the two OUTPUTS)."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", "ext_proc.proto"]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on ext_proc.proto")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in OUTPUTS:
            (HERE / name).write_bytes((Path(tmp) / name).read_bytes())
    print(f"Wrote {', '.join(OUTPUTS)} in {HERE}", file=sys.stderr)


if __name__ == "__main__":
    main()
