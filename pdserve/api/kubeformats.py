"""Kubernetes' own formats (label keys and values, resource names, env var names, namespaces) as pydantic types.

What the API server refuses in a child (a StatefulSet with a nodeSelector key `bad key!`, a topology key whose name
part is 64 characters) must be refused when the PDService is written, with the PDService's field named, not later
as an ApplyFailed on an object the user never wrote. Each format is defined once (`Format`: a regular expression
that Python's `re` and the API server's RE2 read alike, length limits, a message) and used three ways:

- a pydantic check (`Format.check`), so `pdserve validate` and the operator refuse the value offline;
- the CRD schema of the field (`pattern`, `maxLength`), so the API server refuses it at admission;
- where a schema cannot say it, CEL generated from the same definition: map keys (a structural schema has no
  `propertyNames`) and the 253-character limit of a qualified name's prefix.

The rules are apimachinery's (k8s.io/apimachinery/pkg/util/validation: IsQualifiedName, IsValidLabelValue,
IsDNS1123Label/Subdomain, IsEnvVarName in its relaxed form, GA since Kubernetes 1.34) and core/v1's container
resource names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any

from pydantic import AfterValidator, WithJsonSchema

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
# The name part of a qualified name (a label key without its prefix, a resource name): 1-63 characters.
_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_QUALIFIED = rf"({_DNS_SUBDOMAIN}/)?{_NAME_PART}"
# Maps (node selectors, resources) hold a handful of entries; the bound keeps the CEL over their keys cheap enough
# for the API server's cost budget.
MAX_MAP_ENTRIES = 64


@dataclass(frozen=True)
class Format:
    """One Kubernetes string format: a full-match regex, length limits and what to tell the user."""

    what: str
    """What a valid value is, for messages: "a label key"."""
    regex: str
    """Unanchored; read alike by Python's `re` and RE2 (no look-around, no backreferences)."""
    rule: str
    """The format in words, e.g. "an optional DNS subdomain prefix and '/', then 1-63 alphanumerics ..."."""
    max_length: int | None = None
    max_prefix: int | None = None
    """For qualified names: the longest the part before '/' may be (CEL and the check both enforce it)."""

    @property
    def pattern(self) -> str:
        return f"^({self.regex})$"

    @property
    def message(self) -> str:
        return f"must be {self.what}: {self.rule}"

    def ok(self, value: str) -> bool:
        if self.max_length is not None and len(value) > self.max_length:
            return False
        if self.max_prefix is not None and value.find("/") > self.max_prefix:
            return False
        return re.fullmatch(self.regex, value) is not None

    def cel(self, var: str) -> str:
        """The same check as a CEL expression over the string variable `var` (a map key, or `self`)."""
        escaped = self.pattern.replace("\\", "\\\\").replace("'", "\\'")
        parts = [f"{var}.matches('{escaped}')"]
        if self.max_length is not None:
            parts.insert(0, f"{var}.size() <= {self.max_length}")
        if self.max_prefix is not None:
            # indexOf is -1 without a prefix; with one it is the prefix's length.
            parts.append(f"{var}.indexOf('/') <= {self.max_prefix}")
        return " && ".join(parts)

    def json_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "string", "pattern": self.pattern}
        if self.max_length is not None:
            schema["maxLength"] = self.max_length
        if self.max_prefix is not None:
            rule = f"self.indexOf('/') <= {self.max_prefix}"
            message = f"the prefix before '/' must be at most {self.max_prefix} characters"
            schema["x-kubernetes-validations"] = [{"rule": rule, "message": message}]
        return schema

    def check(self, value: str) -> str:
        """Pydantic after-validator: `value` unchanged, or ValueError with the message."""
        if not self.ok(value):
            raise ValueError(self.message)
        return value


LABEL_KEY = Format(
    "a label key",
    _QUALIFIED,
    "an optional DNS subdomain prefix (at most 253 characters) and '/', then a name of 1-63 letters, digits, "
    "'-', '_' or '.' that starts and ends with a letter or digit, e.g. topology.kubernetes.io/zone",
    max_length=253 + 1 + 63,
    max_prefix=253,
)
LABEL_VALUE = Format(
    "a label value",
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?",
    "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit (or empty)",
    max_length=63,
)
TOLERATION_KEY = Format("a label key or empty", f"({_QUALIFIED})?", LABEL_KEY.rule, 253 + 1 + 63, 253)
EXTENDED_RESOURCE = Format(
    "an extended resource name",
    rf"{_DNS_SUBDOMAIN}/{_NAME_PART}",
    "a DNS subdomain prefix (at most 253 characters), '/', then a name of 1-63 letters, digits, '-', '_' or '.', "
    "e.g. nvidia.com/gpu or rdma/ib",
    max_length=253 + 1 + 63,
    max_prefix=253,
)
CONTAINER_RESOURCE = Format(
    "a container resource name",
    rf"cpu|memory|ephemeral-storage|hugepages-[A-Za-z0-9.]+|{_DNS_SUBDOMAIN}/{_NAME_PART}",
    "cpu, memory, ephemeral-storage, hugepages-<size>, or an extended resource name such as example.com/device",
    max_length=253 + 1 + 63,
    max_prefix=253,
)
ENV_VAR_NAME = Format(
    "an environment variable name",
    r"[ -<>-~]+",
    "printable ASCII characters other than '='",
    max_length=1024,
)
DNS_LABEL = Format(
    "a DNS label",
    _DNS_LABEL,
    "at most 63 lowercase letters, digits or '-', starting and ending with a letter or digit",
    max_length=63,
)
DNS_SUBDOMAIN = Format(
    "a DNS subdomain",
    _DNS_SUBDOMAIN,
    "at most 253 lowercase letters, digits, '-' or '.', each dot-separated part starting and ending with a "
    "letter or digit",
    max_length=253,
)


QUANTITY = Format(
    "a Kubernetes quantity",
    r"[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i|[numkMGTPE])?",
    "a number with an optional suffix Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E or an exponent, e.g. 500m "
    "or 16Gi",
    max_length=64,
)


def keys_in(keys: Format) -> AfterValidator:
    """A pydantic check that every key of a map has the format `keys` (the message quotes the offending key)."""

    def check(value: Mapping[str, Any]) -> Mapping[str, Any]:
        if len(value) > MAX_MAP_ENTRIES:
            raise ValueError(f"at most {MAX_MAP_ENTRIES} entries")
        for key in value:
            if not keys.ok(key):
                raise ValueError(f"key {_short(key)} {keys.message}")
        return value

    return AfterValidator(check)


def map_schema(keys: Format, values: Format) -> WithJsonSchema:
    """The CRD schema of a map with these key and value formats: values by additionalProperties, keys by CEL
    (structural schemas have no propertyNames)."""
    rule = {"rule": f"self.all(k, {keys.cel('k')})", "message": f"every key {keys.message}"}
    return WithJsonSchema(
        {
            "type": "object",
            "maxProperties": MAX_MAP_ENTRIES,
            "additionalProperties": values.json_schema(),
            "x-kubernetes-validations": [rule],
        }
    )


def _short(text: str, limit: int = 60) -> str:
    """`text` quoted, cut to `limit` characters: a message never echoes a hostile input at length."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


# The types the models use. Spelled out (not built by a function) so type checkers see `str` and `dict[str, str]`.
LabelKey = Annotated[str, AfterValidator(LABEL_KEY.check), WithJsonSchema(LABEL_KEY.json_schema())]
LabelValue = Annotated[str, AfterValidator(LABEL_VALUE.check), WithJsonSchema(LABEL_VALUE.json_schema())]
TolerationKey = Annotated[str, AfterValidator(TOLERATION_KEY.check), WithJsonSchema(TOLERATION_KEY.json_schema())]
ExtendedResourceName = Annotated[
    str, AfterValidator(EXTENDED_RESOURCE.check), WithJsonSchema(EXTENDED_RESOURCE.json_schema())
]
EnvVarName = Annotated[str, AfterValidator(ENV_VAR_NAME.check), WithJsonSchema(ENV_VAR_NAME.json_schema())]
Namespace = Annotated[str, AfterValidator(DNS_LABEL.check), WithJsonSchema(DNS_LABEL.json_schema())]
SecretName = Annotated[str, AfterValidator(DNS_SUBDOMAIN.check), WithJsonSchema(DNS_SUBDOMAIN.json_schema())]
Quantity = Annotated[str, AfterValidator(QUANTITY.check), WithJsonSchema(QUANTITY.json_schema())]
LabelSelectorMap = Annotated[dict[str, LabelValue], keys_in(LABEL_KEY), map_schema(LABEL_KEY, LABEL_VALUE)]
ResourceMap = Annotated[dict[str, Quantity], keys_in(CONTAINER_RESOURCE), map_schema(CONTAINER_RESOURCE, QUANTITY)]


_QUANTITY_SUFFIXES: dict[str, int | Decimal] = {
    "": 1,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity_bytes(value: str) -> int:
    """A byte count written as a Kubernetes quantity (e.g. 16Gi, 500M, 1e9), rounded down to whole bytes."""
    match = re.fullmatch(r"\+?([0-9.]+(?:[eE][-+]?[0-9]+)?)([KMGTPE]i|[numkMGTPE])?", value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, suffix = match.group(1), match.group(2) or ""
    return int(Decimal(number) * Decimal(_QUANTITY_SUFFIXES[suffix]))
