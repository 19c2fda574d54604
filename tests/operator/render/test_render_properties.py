"""Property tests: for any spec the models accept, render either raises InvalidSpecError or returns objects that
are owned, labelled, deterministic, and pair prefill with decode under one kv-compat label."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.api.kvcompat import KV_COMPAT_LABEL
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import InvalidSpecError, validate
from pdserve_operator.render import render

small = st.integers(min_value=0, max_value=8)
positive = st.integers(min_value=1, max_value=8)
label_key = st.sampled_from(["topology.kubernetes.io/zone", "pdserve.io/rack", "nvidia.com/gpu.clique"])


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


autoscaling = st.fixed_dictionaries(
    {},
    optional={
        "enabled": st.booleans(),
        "minReplicas": small,
        "maxReplicas": positive,
        "targetMilliseconds": st.floats(1, 1e4),
    },
)
pool = st.fixed_dictionaries(
    {},
    optional={
        "replicas": small,
        "tensorParallelSize": positive,
        "dataParallelSize": st.integers(1, 2),
        "gpusPerPod": small,
        "rdma": st.fixed_dictionaries({}, optional={"resourceName": st.just("rdma/ib"), "count": positive}),
        "nodeSelector": st.dictionaries(label_key, st.sampled_from(["a", "b"]), max_size=2),
        "maxNumSeqs": positive,
        "args": st.lists(st.sampled_from(["--enforce-eager", "--port", "--x=1"]), max_size=3),
        "autoscaling": autoscaling,
        "maxUnavailable": small,
    },
)
spec = st.fixed_dictionaries(
    {
        "model": st.fixed_dictionaries(
            {
                "name": st.sampled_from(["m", "org/Model-1"]),
                "uri": st.sampled_from(["hf://org/m", "pvc://claim/p", "pvc://claim", "/mnt/m"]),
            },
            optional={"revision": st.sampled_from(["main", "abc123"])},
        ),
        "engine": st.fixed_dictionaries(
            {"image": st.sampled_from(["vllm/vllm-openai:v0.32.0", "registry.local/vllm:dev"])},
            optional={
                "blockSize": st.sampled_from([16, 32, 128]),
                "kvCacheDtype": st.sampled_from(["auto", "fp8"]),
                "maxModelLen": st.integers(16, 131072),
                "attention": st.sampled_from(["standard", "mla"]),
                "port": st.sampled_from([8000, 5600, 9000]),
            },
        ),
    },
    optional={
        "prefill": pool,
        "decode": pool,
        "placement": st.fixed_dictionaries(
            {},
            optional={
                "rdma": st.sampled_from(["required", "preferred", "off"]),
                "topologyKey": label_key,
                "colocation": st.sampled_from(["required", "preferred", "none"]),
                "spreadKey": label_key,
            },
        ),
        "router": st.fixed_dictionaries(
            {},
            optional={
                "replicas": small,
                "port": st.integers(1, 65535),
                "routing": st.fixed_dictionaries({}, optional={"disaggregationThreshold": st.integers(0, 10000)}),
            },
        ),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=spec, name=st.from_regex(r"[a-z][a-z0-9]{0,20}", fullmatch=True))
def test_render_never_crashes_and_owns_everything(spec: dict[str, Any], name: str) -> None:
    pds = PDService.model_validate({"metadata": {"name": name, "namespace": "ns", "uid": "uid"}, "spec": spec})
    try:
        objects = render(validate(pds))
    except InvalidSpecError as exc:
        assert exc.problems, "InvalidSpecError without problems"
        return
    assert objects == render(validate(pds))
    names = set()
    for obj in objects:
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == name
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pdserve-operator"
        assert meta["ownerReferences"][0]["uid"] == "uid"
        assert len(meta["name"]) <= 63
        names.add((obj["kind"], meta["name"]))
    assert len(names) == len(objects), "duplicate object"
    compat = {
        o["spec"]["template"]["metadata"]["labels"][KV_COMPAT_LABEL] for o in objects if o["kind"] == "StatefulSet"
    }
    assert len(compat) == 1
    # The router, whatever the spec, reads EndpointSlices, its discovery ConfigMap and its control one, never a Pod.
    [role] = [o for o in objects if o["kind"] == "Role"]
    for rule in role["rules"]:
        assert set(rule["verbs"]) == {"list", "watch"}
        assert (rule["apiGroups"], rule["resources"]) in (
            (["discovery.k8s.io"], ["endpointslices"]),
            ([""], ["configmaps"]),
        )
        if rule["resources"] == ["configmaps"]:
            assert rule["resourceNames"] == [f"{name}-router-discovery", f"{name}-router-control"]
