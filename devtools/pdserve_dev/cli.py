"""`pdserve dev cluster build|up|down|status|kubeconfig`: the local cluster from the command line.

`up` leaves the cluster running after the command returns (its processes are detached and recorded in the
workdir); `down` stops them by their recorded PIDs, which also works after the machine's Python crashed.
A cluster is found by `--workdir`, or by `--name` under `$PDSERVE_CACHE_DIR/clusters/`.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from pdserve_dev.cluster import build as build_mod
from pdserve_dev.cluster import netns, tools, versions
from pdserve_dev.cluster.cluster import (
    PROCESS_NODE_MODULE,
    ClusterError,
    ClusterState,
    LocalCluster,
    cluster_status,
    default_workdir,
    stop_workdir,
)
from pdserve_dev.cluster.topology import TOPOLOGIES


@click.group()
def dev() -> None:
    """Developer tools: the local Kubernetes cluster."""


@dev.command("demo")
@click.option(
    "-f",
    "--filename",
    "manifest",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="PDService YAML to run (default: the embedded examples/local-sim.yaml).",
)
@click.option("--keep", is_flag=True, help="Keep everything running at the end (Ctrl-C stops it).")
def demo(manifest: str | None, keep: bool) -> None:
    """The whole product on the local cluster: Helm install, PDService, a routed prefill -> decode request."""
    from pdserve_dev.demo import main  # imports the cluster tooling; only this command needs it

    raise SystemExit(main(manifest, keep, click.echo))


@dev.group()
def cluster() -> None:
    """The local cluster: real control plane, kwok GPU nodes, optional process node."""


def _workdir_options(function: click.decorators.FC) -> click.decorators.FC:
    function = click.option(
        "--workdir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Cluster state directory (default: $PDSERVE_CACHE_DIR/clusters/<name>).",
    )(function)
    return click.option("--name", default="default", show_default=True, help="Cluster name.")(function)


def _enter_cluster_namespace(directory: Path) -> None:
    """Re-run this command inside the cluster's named network namespace (netns.py) when it should be there.

    Never returns when it re-runs: the exit code of the re-run command is this command's."""
    if not netns.should_isolate():
        return
    name = netns.named_namespace(directory)
    netns.ensure_named(name)
    raise SystemExit(netns.run_in_named(name, [sys.executable, "-m", "pdserve.cli", *sys.argv[1:]]))


def _load_state(directory: Path) -> ClusterState:
    """The saved state of the cluster in `directory`, or a clear error when there is none."""
    state = ClusterState.load(directory)
    if state is None:
        raise click.ClickException(f"No cluster in {directory}; start one with `pdserve dev cluster up`")
    return state


def _resolve(name: str, workdir: Path | None) -> Path:
    return (workdir or default_workdir(name)).resolve()


@cluster.command("build")
@click.option("--force", is_flag=True, help="Rebuild binaries that are already cached.")
@click.option(
    "--prune-go-cache",
    is_flag=True,
    help="Delete Go's build cache (about 5 GB) after building; a later pin change then compiles from scratch.",
)
@click.argument("binaries", nargs=-1)
def build_command(force: bool, prune_go_cache: bool, binaries: tuple[str, ...]) -> None:
    """Build the pinned binaries (all, or the named ones) into the cache, and with no names the check tools too;
    cached ones are skipped."""
    click.echo(
        f"Kubernetes {versions.KUBERNETES_VERSION}, etcd {versions.ETCD_VERSION}, kwok {versions.KWOK_VERSION}, "
        f"helm {versions.HELM_VERSION} -> {build_mod.bin_dir()}"
    )
    click.echo(f"Prometheus {versions.PROMETHEUS_VERSION} -> {build_mod.bin_dir(toolset=versions.PROMETHEUS)}")
    try:
        report = build_mod.build(binaries or None, force=force, log=click.echo)
    except build_mod.BuildError as exc:
        raise click.ClickException(str(exc)) from exc
    usage = report.disk_usage()
    click.echo(
        f"Done in {report.seconds:.0f}s. Disk: binaries {usage['bin'] / 2**20:.0f} MiB, Go module cache "
        f"{usage['gomodcache'] / 2**20:.0f} MiB, Go build cache {usage['gocache'] / 2**20:.0f} MiB."
    )
    if report.failed:
        raise click.ClickException("Could not build: " + ", ".join(r.name for r in report.failed))
    if not binaries:
        # The check tools the tests use (kstatus-check, the Prometheus Operator CRDs), cached under their own key.
        try:
            tools.ensure_all(log=click.echo)
        except build_mod.BuildError as exc:
            raise click.ClickException(str(exc)) from exc
    if prune_go_cache:
        build_mod.prune_go_build_cache()
        click.echo(f"Removed the Go build cache {build_mod.cache_root() / 'go' / 'build'}.")


@cluster.command("up")
@_workdir_options
@click.option(
    "--topology",
    type=click.Choice(sorted(TOPOLOGIES)),
    default="default",
    show_default=True,
    help="Simulated GPU nodes: default (16), minimal (2), large (128), none.",
)
@click.option(
    "--process-node/--no-process-node",
    default=None,
    help="Run the process node (pods as local processes). Default: when its module is installed.",
)
@click.option(
    "--image-map", type=click.Path(dir_okay=False, exists=True, path_type=Path), help="Image map for the process node."
)
@click.option(
    "--prometheus",
    is_flag=True,
    help="Also run Prometheus, scraping the engine and router pods (added to a running cluster if it lacks one).",
)
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--restart", is_flag=True, help="Restart the cluster if it is already running (fresh etcd).")
def up(
    *,
    name: str,
    workdir: Path | None,
    topology: str,
    process_node: bool | None,
    image_map: Path | None,
    prometheus: bool,
    timeout: float,
    restart: bool,
) -> None:
    """Build what is missing, start the cluster, return once it is ready (it keeps running)."""
    if process_node is None:
        process_node = importlib.util.find_spec(f"{PROCESS_NODE_MODULE}.__main__") is not None
    directory = _resolve(name, workdir)
    _enter_cluster_namespace(directory)
    info = cluster_status(directory)
    if not restart and info["running"]:
        click.echo(f"Cluster {name!r} is already running (workdir {directory}); `--restart` starts it afresh.")
        if prometheus and not (info["prometheus"] or {}).get("ready"):
            try:
                url = LocalCluster.attach(directory, log=click.echo).start_prometheus(timeout)
            except (ClusterError, build_mod.BuildError) as exc:
                raise click.ClickException(str(exc)) from exc
            click.echo(f"Started Prometheus at {url}.")
        click.echo(f"export KUBECONFIG={directory / 'kubeconfig'}")
        return
    started = time.monotonic()
    local = LocalCluster(
        directory,
        topology=topology,
        process_node=process_node,
        prometheus=prometheus,
        image_map=image_map,
        detach=True,
        ready_timeout=timeout,
        log=click.echo,
    )
    try:
        local.start()
    except (ClusterError, build_mod.BuildError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"Cluster {name!r} is up after {time.monotonic() - started:.1f}s (workdir {directory}).")
    click.echo(f"export KUBECONFIG={local.kubeconfig}")
    if local.prometheus_url is not None:
        click.echo(f"Prometheus: {local.prometheus_url}")
    _namespace_hint(directory)


def _namespace_hint(directory: Path) -> None:
    name = netns.named_namespace(directory)
    if netns.named_exists(name):
        click.echo(
            f"The cluster lives in network namespace {name}: run clients with `ip netns exec {name} ...` "
            "or use `pdserve dev cluster kubectl ...`."
        )


@cluster.command("down")
@_workdir_options
def down(name: str, workdir: Path | None) -> None:
    """Stop every process of the cluster (by recorded PIDs); logs stay in the workdir."""
    directory = _resolve(name, workdir)
    stopped = stop_workdir(directory)
    netns.delete_named(netns.named_namespace(directory))
    click.echo(f"Stopped {', '.join(stopped)}." if stopped else f"Nothing was running in {directory}.")


@cluster.command("status")
@_workdir_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(name: str, workdir: Path | None, as_json: bool) -> None:
    """Show whether the cluster runs: processes, API readiness, nodes. Exit 1 when it does not."""
    directory = _resolve(name, workdir)
    if netns.named_exists(netns.named_namespace(directory)):
        _enter_cluster_namespace(directory)
    info = cluster_status(directory)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        click.echo(f"workdir:    {info['workdir']}")
        click.echo(f"running:    {info['running']}")
        if "server" in info:
            click.echo(f"server:     {info['server']}")
            click.echo(f"kubeconfig: {info['kubeconfig']}")
            click.echo(f"topology:   {info['topology']} (process node: {info['process_node']})")
            click.echo(f"nodes:      {info['nodes'].get('ready', 0)}/{info['nodes'].get('total', 0)} ready")
            if info["prometheus"] is not None:
                ready = "ready" if info["prometheus"]["ready"] else "NOT READY"
                click.echo(f"prometheus: {info['prometheus']['url']} ({ready})")
            for component in info["components"]:
                state = "running" if component["alive"] else "STOPPED"
                click.echo(f"  {component['name']:<24} pid {component['pid']:<8} {state}")
    if not info["running"]:
        raise SystemExit(1)


@cluster.command("kubeconfig")
@_workdir_options
def kubeconfig(name: str, workdir: Path | None) -> None:
    """Print the path of the cluster's admin kubeconfig."""
    directory = _resolve(name, workdir)
    state = _load_state(directory)
    click.echo(state.kubeconfig)
    if netns.named_exists(netns.named_namespace(directory)):
        click.echo(f"(reachable inside network namespace {netns.named_namespace(directory)})", err=True)


@cluster.command("env")
@_workdir_options
def env(name: str, workdir: Path | None) -> None:
    """Print shell lines that put the built binaries on PATH and select the cluster: `eval "$(... env)"`."""
    directory = _resolve(name, workdir)
    state = _load_state(directory)
    # prometheus and promtool live in their own cache key's folder (versions.TOOLSETS), when built.
    prometheus_bin = build_mod.bin_dir(toolset=versions.PROMETHEUS)
    extra = f"{shlex.quote(str(prometheus_bin))}:" if prometheus_bin.is_dir() else ""
    click.echo(f'export PATH={shlex.quote(state.bin_dir)}:{extra}"$PATH"')
    click.echo(f"export KUBECONFIG={shlex.quote(state.kubeconfig)}")
    if state.prometheus_url is not None:
        click.echo(f"export PDSERVE_PROMETHEUS_URL={state.prometheus_url}")
    if netns.named_exists(netns.named_namespace(directory)):
        click.echo(f"# the cluster is reachable inside network namespace {netns.named_namespace(directory)}")


@cluster.command("kubectl", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_workdir_options
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def kubectl(name: str, workdir: Path | None, args: tuple[str, ...]) -> None:
    """Run the built kubectl against the cluster, e.g. `pdserve dev cluster kubectl get nodes`."""
    directory = _resolve(name, workdir)
    if netns.named_exists(netns.named_namespace(directory)):
        _enter_cluster_namespace(directory)
    state = _load_state(directory)
    try:
        binary = build_mod.binary("kubectl")
    except build_mod.BuildError as exc:
        raise click.ClickException(str(exc)) from exc
    raise SystemExit(subprocess.call([str(binary), f"--kubeconfig={state.kubeconfig}", *args]))
