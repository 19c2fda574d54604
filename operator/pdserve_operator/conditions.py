"""A condition as the operator decides it: metav1.Condition without the fields the status writer adds.

Status (`status.py`) and the autoscaler's decisions (`autoscaler.decision`) both produce conditions; the reconcile
adds `lastTransitionTime` (moved only when the status flips) and `observedGeneration` when it writes them
(`status.merge_conditions`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Condition:
    """One condition: its type, status (True, False, Unknown), a CamelCase reason and a message for humans."""

    type: str
    status: str
    reason: str
    message: str = ""
