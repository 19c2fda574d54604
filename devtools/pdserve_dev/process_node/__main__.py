"""``python -m pdserve_dev.process_node``: run the process node until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType

import click

from pdserve_dev.process_node import launch
from pdserve_dev.process_node.agent import ProcessNode
from pdserve_dev.process_node.imagemap import ImageMap, ImageMapError
from pdserve_dev.process_node.ipam import PodIPAllocator, loopback_cidr
from pdserve_dev.process_node.kube import Kube
from pdserve_dev.process_node.node import CAPACITY, HOST_IP
from pdserve_dev.process_node.podworker import NodeContext, host_environment


@click.command(name="process-node", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--kubeconfig",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Kubeconfig of the cluster to join.",
)
@click.option("--node-name", required=True, help="Name of the Node object this process registers.")
@click.option(
    "--workdir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for pids/, logs/ and per-pod folders (pods/).",
)
@click.option(
    "--image-map",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="YAML image map whose rules come before the built-in ones.",
)
@click.option(
    "--pod-cidr",
    envvar="PDSERVE_POD_CIDR",
    default=None,
    help="Block of local addresses for pod IPs (env PDSERVE_POD_CIDR; default: a 127.B.0.0/16 derived from "
    "--workdir, which works for direct connections but which EndpointSlices refuse).",
)
@click.option(
    "--shutdown-grace",
    type=float,
    default=10.0,
    show_default=True,
    help="Longest grace period pods get when the process node itself stops.",
)
@click.option(
    "--backoff-initial",
    type=float,
    default=10.0,
    show_default=True,
    help="First CrashLoopBackOff delay in seconds (doubles per crash).",
)
@click.option(
    "--backoff-max", type=float, default=300.0, show_default=True, help="Longest CrashLoopBackOff delay in seconds."
)
@click.option(
    "--sandbox/--no-sandbox",
    default=True,
    show_default=True,
    help="Run containers in their own mount namespace, root, volumes and user when possible (needs root); "
    "--no-sandbox runs them in the host's file system with the node's kubeconfig.",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(
    *,
    kubeconfig: str,
    node_name: str,
    workdir: Path,
    image_map: Path | None,
    pod_cidr: str | None,
    shutdown_grace: float,
    backoff_initial: float,
    backoff_max: float,
    sandbox: bool,
    verbose: bool,
) -> None:
    """Run the pods bound to NODE-NAME as local processes (see the package docstring for what it emulates)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s process-node %(threadName)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        images = ImageMap.load(image_map)
        allocator = PodIPAllocator(pod_cidr or loopback_cidr(str(workdir.resolve())), seed=str(workdir.resolve()))
    except (ImageMapError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    workdir = workdir.resolve()
    logger = logging.getLogger(__name__)
    why_not = launch.probe(workdir / "sandbox-probe") if sandbox else "disabled by --no-sandbox"
    settings = launch.SandboxSettings(reachable=launch.host_reachable_paths()) if why_not is None else None
    if settings is None:
        logger.warning("Running containers without the sandbox (%s): host file system, the node's kubeconfig", why_not)
    ctx = NodeContext(
        kube=Kube(kubeconfig),
        node_name=node_name,
        workdir=workdir,
        image_map=images,
        allocator=allocator,
        host_ip=HOST_IP,
        base_env=host_environment(kubeconfig, sandbox=settings is not None),
        allocatable=dict(CAPACITY),
        shutdown_grace=shutdown_grace,
        backoff_initial=backoff_initial,
        backoff_cap=backoff_max,
        sandbox=settings,
    )
    node = ProcessNode(ctx)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("Received %s, stopping", signal.Signals(signum).name)
        node.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    node.run()


if __name__ == "__main__":
    main()
