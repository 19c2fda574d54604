"""Parse engine command lines with the installed vLLM's own parser. Runs in the vLLM engine's virtualenv.

Input on stdin: a JSON list of ``{"where": str, "argv": [str, ...]}``, each argv the words after ``vllm`` (so
``["serve", MODEL, "--port", ...]``). Output on stdout: a JSON list of ``{"where", "ok", "errors", "parsed"}``.
Used by :mod:`pdserve_dev.realvllm.argcheck`; only the standard library and vLLM are imported (it is never
imported by pdserve).

For each argv, what ``vllm serve`` itself does before it loads a model:

1. the parser ``vllm/entrypoints/cli/main.py`` builds (a FlexibleArgumentParser with the ``serve`` subcommand of
   ``vllm/entrypoints/cli/serve.py``, i.e. ``make_arg_parser``), ``parse_args(argv)``: an unknown, renamed or
   dropped flag fails here with argparse's message naming it; a JSON config flag is validated here too, by
   ``TypeAdapter(<config class>).validate_json`` in ``vllm/engine/arg_utils.py``, and vLLM's config classes forbid
   unknown keys;
2. ``ServeSubcommand.validate`` (``validate_parsed_serve_args``: vLLM's checks that need no model; the engine
   arguments proper, ``AsyncEngineArgs.from_cli_args``, would resolve the model on the hub, so they are left to
   the tier's real engines, which run the rendered command line for a model that exists);
3. ``kv_transfer_config`` / ``kv_events_config`` are instances of ``vllm.config.KVTransferConfig`` /
   ``KVEventsConfig`` (the classes vLLM builds its engine config from);
4. a ``MultiConnector``'s children are built by vLLM's own ``MultiConnector._get_connector_classes_and_configs``
   (what the engine does at start-up: each child dict into ``KVTransferConfig``, its class through the connector
   factory), so a child vLLM cannot build fails here, as the rendered nested ``engine_id`` once did;
5. ``kv_connector_extra_config`` is a free-form dict vLLM does not validate, so each key, of the connector and of
   every child, must be one the code that configures that connector reads (``"<key>"`` in its source): a key vLLM
   renamed would otherwise be ignored silently.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import pathlib
import sys
import types
from typing import Any


def _parser() -> Any:
    argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
    serve = importlib.import_module("vllm.entrypoints.cli.serve")
    parser = argparse_utils.FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    command = serve.ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    return parser, command


# Where a connector reads its kv_connector_extra_config, beyond its own module (or its package, when it lives in a
# folder of its own): OffloadingConnector hands its settings to the offloading spec (`OffloadingSpecFactory`).
SETTINGS_READERS = {
    "OffloadingConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading",
        "vllm.v1.kv_offload",
    ),
}


def _module_sources(name: str) -> list[pathlib.Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return []
    origin = pathlib.Path(spec.origin)
    if spec.submodule_search_locations or origin.parent.name != "v1":
        # A package, or a module in a connector's own folder (nixl/, mooncake/store/): the whole folder.
        return sorted(origin.parent.rglob("*.py"))
    return [origin]


def _connector_sources(name: str) -> str:
    factory = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory
    modules = (factory.get_connector_class_by_name(name).__module__, *SETTINGS_READERS.get(name, ()))
    return "\n".join(path.read_text() for module in modules for path in _module_sources(module))


def _extra_config_errors(kv_transfer: Any, where: str) -> list[str]:
    extra = kv_transfer.kv_connector_extra_config or {}
    if not extra:
        return []
    sources = _connector_sources(kv_transfer.kv_connector)
    return [
        f"{where}kv_connector_extra_config key {key!r} is read nowhere in {kv_transfer.kv_connector}'s code"
        for key in extra
        if f'"{key}"' not in sources and f"'{key}'" not in sources
    ]


def _children(kv_transfer: Any) -> list[Any]:
    """A MultiConnector's child configs, built by vLLM's own code as the engine builds them."""
    multi = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector").MultiConnector
    built = multi._get_connector_classes_and_configs(types.SimpleNamespace(kv_transfer_config=kv_transfer))
    return [config.kv_transfer_config for _, config in built]


def _kv_transfer_errors(kv_transfer: Any) -> tuple[list[str], list[Any]]:
    errors = _extra_config_errors(kv_transfer, "")
    if kv_transfer.kv_connector != "MultiConnector":
        return errors, [kv_transfer]
    try:
        children = _children(kv_transfer)
    except Exception as exc:  # what the engine would die of at start-up (TypeError, ValidationError, ...)
        return [*errors, f"MultiConnector child: {type(exc).__name__}: {exc}"], []
    for index, child in enumerate(children):
        errors += _extra_config_errors(child, f"MultiConnector child {index} ({child.kv_connector}): ")
    return errors, children


def check(parser: Any, command: Any, argv: list[str]) -> dict[str, Any]:
    config = importlib.import_module("vllm.config")
    errors: list[str] = []
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(argv)
    except SystemExit:
        # argparse prints the usage, then "PROG: error: MESSAGE" (a config class's validation error continues
        # on the following lines, naming the field): keep the message from "error:" on.
        text = stderr.getvalue()
        message = text[text.find("error:") :] if "error:" in text else text
        return {"ok": False, "errors": [" ".join(message.split())], "parsed": {}}
    except (ValueError, argparse.ArgumentTypeError) as exc:
        return {"ok": False, "errors": [f"{type(exc).__name__}: {exc}"], "parsed": {}}
    if hasattr(args, "model_tag") and args.model_tag is not None:
        args.model = args.model_tag
    try:
        command.validate(args)
    except Exception as exc:  # vLLM raises ValueError, TypeError, AssertionError here
        return {"ok": False, "errors": [f"{type(exc).__name__}: {exc}"], "parsed": {}}
    kv_transfer, kv_events = args.kv_transfer_config, args.kv_events_config
    connectors: list[Any] = []
    if kv_transfer is not None:
        if not isinstance(kv_transfer, config.KVTransferConfig):
            errors.append(f"--kv-transfer-config gave {type(kv_transfer).__name__}, not KVTransferConfig")
        else:
            transfer_errors, connectors = _kv_transfer_errors(kv_transfer)
            errors += transfer_errors
    if kv_events is not None and not isinstance(kv_events, config.KVEventsConfig):
        errors.append(f"--kv-events-config gave {type(kv_events).__name__}, not KVEventsConfig")
    parsed = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "port": args.port,
        "block_size": args.block_size,
        "kv_connector": getattr(kv_transfer, "kv_connector", None),
        "kv_role": getattr(kv_transfer, "kv_role", None),
        "kv_events": kv_events is not None,
        "kv_events_config": dataclasses.asdict(kv_events) if kv_events is not None else None,
        # The connectors the engine runs (a MultiConnector's children, in order), as vLLM built them.
        "connectors": [
            {"kv_connector": c.kv_connector, "kv_role": c.kv_role, "engine_id": c.engine_id} for c in connectors
        ],
    }
    return {"ok": not errors, "errors": errors, "parsed": parsed}


def main() -> int:
    items = json.load(sys.stdin)
    parser, command = _parser()
    results = [{"where": item["where"], **check(parser, command, list(item["argv"]))} for item in items]
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
