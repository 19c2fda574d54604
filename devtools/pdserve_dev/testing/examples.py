"""The shipped examples (`examples/*.yaml`) and the cluster policy they are written for.

`examples/mla-hostpath-tcp.yaml` reads its weights from a node folder, which a cluster allows only when its
administrator says so (`pdserve operator --allow-model-host-paths /mnt/models`). Tests that validate or render
every example use this one policy, as that administrator would.
"""

from __future__ import annotations

from pdserve.api.policy import Policy

MODEL_HOST_PATHS = ("/mnt/models",)
POLICY = Policy.allowing(model_host_paths=MODEL_HOST_PATHS)
