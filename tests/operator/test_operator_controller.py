"""The controller's event intake and work queue wiring, without a cluster (the IO layer is FakeKube).

A pod's watch event must queue the PDService it belongs to (that is how a crashed engine reaches the status within
one pass instead of one resync), and a pass that asks to run again later (a crash's recovery window) must be run
again then, with no event at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import yaml

from pdserve.api.policy import DEFAULT_POLICY
from pdserve.api.settings import OperatorSettings
from pdserve_dev.testing.fake_kube import FakeKube
from pdserve_dev.testing.owners import controlled
from pdserve_dev.testing.wait import wait_for_async
from pdserve_operator.controller import Controller
from pdserve_operator.kinds import OBSERVED
from pdserve_operator.kube import ApiError, KubeApi
from pdserve_operator.metrics import OperatorMetrics
from pdserve_operator.reconcile import utc_now
from pdserve_operator.view import SpecViews

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdservice.yaml"
NAMESPACE, NAME = "default", "llama-8b"
#: When the crashed engine of the requeue test became ready again, and the moment that test's passes run at.
READY_AT = "2026-01-01T00:00:00Z"


def new_controller(
    kube: FakeKube,
    crash_window: float = OperatorSettings.crash_recovery_seconds,
    now: Callable[[], str] = utc_now,
) -> Controller:
    """A controller over `kube` with the operator's default settings (`OperatorSettings`), its passes reading the
    clock `now`."""
    defaults = OperatorSettings()
    # FakeKube implements the writes a reconcile makes (KubeIO); the controller's relist, not used here, would
    # need the real KubeApi.
    return Controller(
        cast(KubeApi, kube),
        views=SpecViews(DEFAULT_POLICY),
        workers=defaults.workers,
        resync_seconds=defaults.resync_seconds,
        relist_seconds=defaults.relist_seconds,
        crash_window=crash_window,
        namespaces=(),
        metrics=OperatorMetrics(),
        now=now,
    )


def controller(
    crash_window: float = OperatorSettings.crash_recovery_seconds, now: Callable[[], str] = utc_now
) -> tuple[Controller, FakeKube]:
    kube = FakeKube()
    return new_controller(kube, crash_window, now), kube


def pod(owner: str, *, ready_at: str | None = None) -> dict[str, Any]:
    """An engine pod of `owner` whose container crashed once; running and ready since `ready_at` when given."""
    ready = ready_at is not None
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{owner}-decode-0",
            "namespace": NAMESPACE,
            "resourceVersion": "7",
            "labels": {"app.kubernetes.io/instance": owner, "pdserve.io/role": "decode"},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": ready_at or ""}],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "restartCount": 1,
                    "ready": ready,
                    "state": {"running": {"startedAt": ready_at or ""}},
                    "lastState": {"terminated": {"exitCode": 70, "reason": "Error", "finishedAt": ready_at or ""}},
                }
            ],
        },
    }


async def test_a_pod_event_queues_its_pdservice() -> None:
    ctl, kube = controller()
    ctl.on_owner_event({"type": "ADDED", "object": kube.add_owner(yaml.safe_load(EXAMPLE.read_text()))})
    assert await asyncio.wait_for(ctl.queue.get(), 1) == (NAMESPACE, NAME)
    ctl.queue.done((NAMESPACE, NAME))
    ctl.on_child_event({"type": "MODIFIED", "object": pod(NAME)})
    assert len(ctl.queue) == 1
    assert await asyncio.wait_for(ctl.queue.get(), 1) == (NAMESPACE, NAME)
    # A pod of a PDService the operator does not know (another namespace's, or deleted) queues nothing.
    ctl.on_child_event({"type": "MODIFIED", "object": pod("unknown")})
    assert len(ctl.queue) == 0


async def test_a_pass_that_asks_to_run_again_is_run_again_without_an_event() -> None:
    # The pass's clock stands still at the moment the crashed engine became ready again, so the pass always sees
    # the crash inside its one-second recovery window (timestamps have one-second resolution: with the real clock,
    # a pass that ran in the next second saw the window over and asked for nothing). It asks to run again once
    # the window is over: in int(1) + 1 = 2 s.
    ctl, kube = controller(crash_window=1.0, now=lambda: READY_AT)
    ctl.on_owner_event({"type": "ADDED", "object": kube.add_owner(yaml.safe_load(EXAMPLE.read_text()))})
    key = await asyncio.wait_for(ctl.queue.get(), 1)
    await ctl._process(key)  # creates the children
    # The crashed engine (of the decode StatefulSet) is ready again as of the passes' clock.
    decode = kube.objects[("StatefulSet", NAMESPACE, f"{NAME}-decode")]
    ctl.store.put(controlled(pod(NAME, ready_at=READY_AT), decode))
    await ctl._process(key)
    ctl.queue.done(key)
    assert len(ctl.queue) == 0
    assert await asyncio.wait_for(ctl.queue.get(), 10) == key


class RefusingLists(FakeKube):
    """FakeKube whose lists fail `failures` times (an API server still starting), then answer empty; it notes how
    many lists had been made when the first object was applied."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.refusals = failures
        self.lists = 0
        self.lists_at_first_apply: int | None = None

    def list_at(self, path: str, kind: str, label_selector: str = "") -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        if self.refusals:
            self.refusals -= 1
            raise ApiError(0, "connection refused", "ConnectionError")
        return [], "1"

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.lists_at_first_apply is None:
            self.lists_at_first_apply = self.lists
        return super().apply(obj)


async def test_no_pass_runs_before_the_first_list_which_is_retried_until_it_succeeds() -> None:
    kube = RefusingLists(failures=2)
    ctl = new_controller(kube)
    ctl.on_owner_event({"type": "ADDED", "object": kube.add_owner(yaml.safe_load(EXAMPLE.read_text()))})
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    try:
        # The counted event: the first pass applied the children (the lists found none).
        await wait_for_async(lambda: asyncio.to_thread(lambda: bool(kube.written())), within=10)
        # Two refused lists (each round stops at its first kind), then one list of every watched kind, all before
        # that first apply.
        assert kube.lists_at_first_apply == 2 + len(OBSERVED)
        assert ctl.synced.is_set()
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_controller_stopped_before_its_first_list_exits() -> None:
    kube = RefusingLists(failures=1_000)
    ctl = new_controller(kube)
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    await wait_for_async(lambda: asyncio.to_thread(lambda: kube.lists >= 1), within=5)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert not ctl.synced.is_set()
