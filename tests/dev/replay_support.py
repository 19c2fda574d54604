"""Helpers shared by the replay's tests."""

from __future__ import annotations

from pdserve_dev.replay.observe import Observation


class Script:
    """A scaler that asks for given sizes from given times on (to test the cluster, not a policy)."""

    name = "script"

    def __init__(self, plan: list[tuple[float, tuple[int, int]]]) -> None:
        self.plan = plan
        self.seen: list[Observation] = []

    def tick(self, observation: Observation) -> tuple[int, int]:
        self.seen.append(observation)
        size = self.plan[0][1]
        for at, wanted in self.plan:
            if observation.at >= at:
                size = wanted
        return size
