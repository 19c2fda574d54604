"""How a default is declared once and a spec resolved into its effective view: the mechanism behind `defaults.py`.

A *view* is a frozen dataclass that mirrors one API model field for field (same snake_case names; `view()` checks
that when the class is defined, so a field added to a model without its view fails at import, not in production).
Each view field says what an absent value becomes:

- `port: int = default(8000)`: a constant. `crdgen` appends its text ("Default 8000.") to the model field's
  description in the CRD, so `kubectl explain` and the code read the same single line.
- `gpus_per_pod: int = derived("tensorParallelSize x dataParallelSize")`: computed from other fields by
  `defaults.effective` (the text documents the rule); until then the field holds `UNSET`.
- no default: the user's value as is (None stays None). Lists become tuples, maps read-only mappings and a nested
  model its view, resolved from an empty model when the user left it out, so consumers never test for None
  on a path to a defaulted field.

Absent means None; for a string field with a default, "" is absent too (Kubernetes' omitempty convention, and what
the renderer's `value or default` always did).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, TypeVar, get_origin, get_type_hints

from pydantic import BaseModel

T = TypeVar("T")
V = TypeVar("V")

_DOC = "pdserve.default.doc"
_DERIVED = "pdserve.default.derived"


class _Unset:
    """The value of a derived field between `resolve` and the step of `defaults.effective` that computes it."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final[Any] = _Unset()

_VIEWS: dict[type[BaseModel], type[Any]] = {}


def default(value: T, *, doc: str | None = None) -> T:
    """A view field's constant default. `doc` is the text after "Default" in the CRD; scalars describe themselves."""
    metadata = {_DOC: _describe(value) if doc is None else doc}
    try:
        hash(value)
    except TypeError:
        # A read-only mapping or a tuple of models: one shared instance is safe, the views are immutable.
        return dataclasses.field(default_factory=lambda: value, metadata=metadata)
    return dataclasses.field(default=value, metadata=metadata)


def derived(doc: str) -> Any:
    """A view field whose default `defaults.effective` computes from other fields; `doc` says how."""
    return dataclasses.field(default=UNSET, metadata={_DOC: doc, _DERIVED: True})


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise TypeError(f"say in words what the default {value!r} is: default(..., doc=...)")


def view(model: type[BaseModel]) -> Callable[[type[V]], type[V]]:
    """Register a dataclass as the effective view of `model` after checking that it has exactly its fields."""

    def register(cls: type[V]) -> type[V]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass (put @view above @dataclass)")
        names = {f.name for f in dataclasses.fields(cls)}
        missing, extra = set(model.model_fields) - names, names - set(model.model_fields)
        if missing or extra:
            raise TypeError(
                f"{cls.__name__} must mirror {model.__name__}: missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        _VIEWS[model] = cls
        return cls

    return register


def view_of(model: type[BaseModel]) -> type[Any] | None:
    """The view registered for `model`, if any."""
    return _VIEWS.get(model)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one view field is resolved, worked out once per class from its type hints."""

    field: dataclasses.Field[Any]
    has_default: bool
    nested: type[Any] | None
    container: type | None  # tuple or Mapping


_PLANS: dict[type[Any], tuple[_Plan, ...]] = {}


def _plans(cls: type[Any]) -> tuple[_Plan, ...]:
    if cls not in _PLANS:
        _PLANS[cls] = _make_plans(cls)
    return _PLANS[cls]


def _make_plans(cls: type[Any]) -> tuple[_Plan, ...]:
    hints = get_type_hints(cls)
    plans = []
    views = set(_VIEWS.values())
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        origin = get_origin(hint)
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        plans.append(
            _Plan(
                field=f,
                has_default=has_default,
                nested=hint if hint in views else None,
                container=origin if origin in (tuple, Mapping) else None,
            )
        )
    return tuple(plans)


def resolve(cls: type[V], source: BaseModel | None) -> V:
    """The view `cls` of `source` (None: an absent object, every field at its default). Derived fields stay UNSET."""
    values: dict[str, Any] = {}
    for plan in _plans(cls):
        raw = None if source is None else getattr(source, plan.field.name)
        if plan.has_default and (raw is None or (isinstance(raw, str) and not raw)):
            continue  # the dataclass fills in the default (or UNSET for a derived field)
        if plan.nested is not None:
            values[plan.field.name] = resolve(plan.nested, raw)
        elif plan.container is tuple:
            values[plan.field.name] = tuple(raw or ())
        elif plan.container is Mapping:
            values[plan.field.name] = MappingProxyType(dict(raw or {}))
        else:
            values[plan.field.name] = raw
    return cls(**values)


def field_value(cls: type[Any], source: BaseModel | None, name: str) -> Any:
    """The effective value of one scalar field of `source` under view `cls`, without resolving the whole view
    (for rules that read two or three fields of a large object)."""
    raw = None if source is None else getattr(source, name)
    if raw is None or (isinstance(raw, str) and not raw):
        return default_of(cls, name)
    return raw


def fill(obj: V, **values: Any) -> V:
    """`obj` with each derived field that is still UNSET set from `values` (a value the user wrote is kept)."""
    assert dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    changes = {name: value for name, value in values.items() if getattr(obj, name) is UNSET}
    return dataclasses.replace(obj, **changes) if changes else obj


def default_of(cls: type[Any], name: str) -> Any:
    """The constant default of field `name` of view `cls` (for CEL rules and messages that must quote it)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.metadata.get(_DERIVED):
        raise LookupError(f"{cls.__name__}.{name} is derived, it has no constant default")
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise LookupError(f"{cls.__name__}.{name} has no default")


def documented_defaults(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the text after "Default" for every field of `model` whose view declares a default."""
    cls = _VIEWS.get(model)
    if cls is None:
        return {}
    return {f.name: f.metadata[_DOC] for f in dataclasses.fields(cls) if _DOC in f.metadata}


def unset_fields(obj: object, path: str = "") -> list[str]:
    """Dotted paths of derived fields still UNSET anywhere in a view (empty for an effective spec)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return []
    found = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{path}.{f.name}" if path else f.name
        found += [where] if value is UNSET else unset_fields(value, where)
    return found
