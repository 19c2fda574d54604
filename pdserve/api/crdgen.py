"""Generate the PDService CustomResourceDefinition from the pydantic models.

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no `$ref`, no `anyOf` of types, no
`title`/`default` noise. pydantic emits JSON Schema 2020-12 with `$defs` and `anyOf [{...}, {"type": "null"}]` for
optional fields. The conversion is a single recursive walk:

1. `$ref` -> inline the referenced definition (the models have no recursion, so this terminates);
2. `anyOf` with a `null` branch -> the non-null branch (absent is how Kubernetes says null);
3. `const` (Literal of one value) -> a one-element `enum`; numeric `exclusiveMinimum: x` -> `minimum: x` plus
   `exclusiveMinimum: true` (OpenAPI v3.0 form);
4. drop `title` and `default` (defaults live in `pdserve.api.defaults`, not in stored objects);
5. keep `description`, constraints, `enum`, `x-kubernetes-*` extensions.

Before the walk, the two tables join the models' schemas (`_annotate`): each field with a default in
`pdserve.api.defaults` gets "Default <value>." appended to its description, and each model with rules in
`pdserve.api.rules` gets them as `x-kubernetes-validations`. The models themselves state neither.

The result is wrapped in the CRD with the status subresource and printer columns. `pdserve crd` prints it and a
test compares it with the checked-in `crds/pdservice.yaml`.
"""

from __future__ import annotations

from typing import Any, get_args

import yaml
from pydantic import BaseModel

from pdserve.api import v1alpha1
from pdserve.api.defaults import default_sentences
from pdserve.api.rules import BY_MODEL
from pdserve.api.v1alpha1 import MAX_NAME_LENGTH, NAME_PATTERN, PDServiceSpec, PDServiceStatus

_DROP = frozenset({"title", "default"})
_EXCLUSIVE_BOUNDS = {"exclusiveMinimum": "minimum", "exclusiveMaximum": "maximum"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b != {"type": "null"}]
        if len(branches) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            return _structural({**branches[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "$defs":
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in _EXCLUSIVE_BOUNDS:
            # JSON Schema 2020 has numeric exclusive bounds; OpenAPI v3.0 (and so Kubernetes) a bound plus a flag.
            out[_EXCLUSIVE_BOUNDS[key]] = value
            out[key] = True
        elif key in {"properties", "patternProperties"}:
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _structural(value, defs)
    if "properties" in out or isinstance(out.get("additionalProperties"), bool):
        # Structural schemas forbid properties beside additionalProperties and boolean additionalProperties;
        # unknown fields are pruned by the API server and rejected by kubectl's strict field validation.
        out.pop("additionalProperties", None)
    if "enum" in out and "type" not in out:
        out["type"] = _json_type(out["enum"][0])
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string"


def reachable_models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model reachable from `root`'s fields, by the name pydantic gives its `$defs` entry."""
    found: dict[str, type[BaseModel]] = {}

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation.__name__ not in found:
                found[annotation.__name__] = annotation
                for info in annotation.model_fields.values():
                    visit(info.annotation)
            return
        for argument in get_args(annotation):
            visit(argument)

    visit(root)
    return found


def _annotate(node: dict[str, Any], model: type[BaseModel]) -> None:
    """In place: the defaults table's text in `model`'s field descriptions and the rules table's CEL rules."""
    properties = node.get("properties", {})
    for name, sentence in default_sentences(model).items():
        prop = properties[model.model_fields[name].alias or name]
        prop["description"] = f"{prop['description']} {sentence}"
    rules = BY_MODEL.get(model, ())
    if rules:
        node["x-kubernetes-validations"] = [rule.x_kubernetes_validation() for rule in rules]


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one model, with the defaults' text and the CEL rules joined in."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    for name, cls in reachable_models(model).items():
        _annotate(raw if cls is model else defs[name], cls)
    schema: dict[str, Any] = _structural(raw, defs)
    return schema


def _root_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": v1alpha1.PDService.__doc__ or "",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version: pdserve.io/v1alpha1."},
            "kind": {"type": "string", "description": "Kind: PDService."},
            # Kubernetes lets a CRD restrict metadata.name only; the name feeds child names (Services need DNS-1035,
            # StatefulSet pods need room for their controller-revision-hash label).
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": MAX_NAME_LENGTH, "pattern": NAME_PATTERN},
                },
            },
            "spec": openapi_schema(PDServiceSpec),
            "status": openapi_schema(PDServiceStatus),
        },
    }


def _printer_columns() -> list[dict[str, Any]]:
    def column(name: str, path: str, kind: str = "string", *, priority: int = 0) -> dict[str, Any]:
        return {"name": name, "type": kind, "jsonPath": path, **({"priority": priority} if priority else {})}

    # `kubectl get pds -o wide` (priority 1) adds each pool's current pods, why its scaler decided what it did, the
    # client-visible latencies the SLO autoscaler saw and the disaggregation threshold it chose (while it chooses
    # one); the default view stays narrow.
    wide = 1
    return [
        column("Model", ".spec.model.name"),
        column("Prefill-Ready", ".status.prefill.readyReplicas", "integer"),
        column("Prefill-Current", ".status.prefill.replicas", "integer", priority=wide),
        column("Prefill-Desired", ".status.prefill.desiredReplicas", "integer"),
        column("Decode-Ready", ".status.decode.readyReplicas", "integer"),
        column("Decode-Current", ".status.decode.replicas", "integer", priority=wide),
        column("Decode-Desired", ".status.decode.desiredReplicas", "integer"),
        column("Available", '.status.conditions[?(@.type=="Available")].status'),
        column("Prefill-Scaling", ".status.prefill.autoscaling.reason", priority=wide),
        column("Decode-Scaling", ".status.decode.autoscaling.reason", priority=wide),
        column("TTFT-ms", ".status.prefill.autoscaling.observedMilliseconds", "number", priority=wide),
        column("ITL-ms", ".status.decode.autoscaling.observedMilliseconds", "number", priority=wide),
        column("PD-Threshold", ".status.disaggregationThreshold.tokens", "integer", priority=wide),
        column("Age", ".metadata.creationTimestamp", "date"),
    ]


def custom_resource_definition() -> dict[str, Any]:
    """The whole CRD object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{v1alpha1.PLURAL}.{v1alpha1.GROUP}",
            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/part-of": "pdserve"},
        },
        "spec": {
            "group": v1alpha1.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": v1alpha1.KIND,
                "listKind": f"{v1alpha1.KIND}List",
                "plural": v1alpha1.PLURAL,
                "singular": v1alpha1.SINGULAR,
                "shortNames": list(v1alpha1.SHORT_NAMES),
                "categories": ["all", "pdserve"],
            },
            "versions": [
                {
                    "name": v1alpha1.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(),
                    "schema": {"openAPIV3Schema": _root_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as YAML text, exactly as checked in at crds/pdservice.yaml."""
    header = "# Generated by `pdserve crd` from pdserve/api/v1alpha1.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(custom_resource_definition(), sort_keys=False, width=120)
