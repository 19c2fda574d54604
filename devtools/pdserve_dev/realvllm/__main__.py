"""`python -m pdserve_dev.realvllm install|status|prune`: the real-engine virtualenv (see :mod:`.install`)."""

from __future__ import annotations

import argparse
import sys

from pdserve_dev.realvllm import install


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve_dev.realvllm", description=__doc__)
    parser.add_argument("action", choices=["install", "status", "prune"])
    args = parser.parse_args(argv)
    if args.action == "install":
        try:
            install.install()
        except install.InstallError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    if args.action == "prune":
        install.prune()
        return 0
    if install.installed():
        print(f"installed: {install.venv_dir()}")
        return 0
    print(install.missing_message())
    return 1


if __name__ == "__main__":
    sys.exit(main())
