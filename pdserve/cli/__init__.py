"""The `pdserve` command line: the composition root that wires the API, the operator and the runtime together.

Subcommands are imported lazily so that `pdserve validate` does not pay for importing aiohttp or kopf, and so
that a missing optional dependency of one subcommand never breaks the others. Each entry of `_COMMANDS` maps a
command name to the `module:attribute` of a `click.Command` defined next to the code it drives.
"""

from __future__ import annotations

import importlib

import click

_COMMANDS: dict[str, tuple[str, str]] = {
    "crd": ("pdserve.cli.manifests", "crd"),
    "render": ("pdserve.cli.manifests", "render"),
    "validate": ("pdserve.cli.manifests", "validate"),
    "sim": ("pdserve_sim.cli", "sim"),
    "router": ("pdserve_runtime.router.cli", "router"),
    "picker": ("pdserve_runtime.gateway.cli", "picker"),
    "sidecar": ("pdserve_runtime.gateway.cli", "sidecar"),
    "operator": ("pdserve_operator.cli", "operator"),
    "dev": ("pdserve_dev.cli", "dev"),
}

_HELP: dict[str, str] = {
    "crd": "Print the generated PDService CustomResourceDefinition.",
    "render": "Print every object the operator would create for a PDService.",
    "validate": "Check a PDService and print every problem.",
    "sim": "Run the vLLM-compatible prefill/decode engine simulator.",
    "router": "Run the PD router (OpenAI-compatible endpoint).",
    "picker": "Run the endpoint picker for a Gateway API Inference Extension gateway (Envoy ext_proc).",
    "sidecar": "Run the PD sidecar of a decode pod (router mode gateway).",
    "operator": "Run the PDService operator.",
    "dev": "Developer tools: the local Kubernetes cluster.",
}


# Commands whose code ships in another distribution than `pdserve` (the image and `pip install pdserve` lack it).
_DISTRIBUTION: dict[str, str] = {"dev": "pdserve-dev: pip install -e devtools"}


class _LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attribute = target
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only swallow "this subcommand is not built yet", never a broken import inside it.
            if exc.name is not None and module_name.startswith(exc.name):
                return _unavailable(cmd_name, str(exc))
            raise
        command = getattr(module, attribute)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Describe commands from the static table so `pdserve --help` imports nothing heavy.
        rows = [(name, _HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, reason: str) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def command() -> None:
        hint = f" (install {_DISTRIBUTION[name]})" if name in _DISTRIBUTION else ""
        raise click.ClickException(f"`pdserve {name}` is not available in this build: {reason}{hint}")

    return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pdserve")
def main() -> None:
    """pdserve: prefill/decode disaggregated LLM serving on Kubernetes."""
