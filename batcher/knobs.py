"""How a knob is declared, once: a field of a pydantic model (`knob(...)`) with its type,
default, bounds, unit, help text and whether the admin API may change it live.

Everything else is read from those declarations through `knobs(model)`: the `ferry serve`
flags and FERRY_* environment names (gateway/config.py), the admin API's bodies
(gateway/routes/admin.py), the `ferry_setting_*` gauges (batcher/metrics.py) and the docs'
tables of knobs (gateway/settings_docs.py). Adding a knob is one edit.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, cast, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import JsonDict

# Longest time a millisecond knob may name: an hour.
MAX_MS = 3_600_000
UNIT_WORDS = {"ms": "milliseconds", "s": "seconds"}


class SettingsError(ValueError):
    """A bad value for one knob: `field` names it, `message` says what it accepts."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def knob(
    default: Any,
    help: str,
    *,
    unit: str | None = None,
    live: bool = False,
    gauge: bool = False,
    option: str | None = None,
    null: str | None = None,
    **bounds: Any,
) -> Any:
    """Declare one knob (a pydantic field).

    unit: of its value ("ms", "s", "bytes"). live: the admin PATCH may change it while serving.
    gauge: exported as `ferry_setting_<name>` (milliseconds as seconds, `_ms` as `_seconds`).
    option: its `ferry serve` flag and FERRY_* name when not its own (`mode` is `--batching`).
    null: what null (None) means, for a knob that may be null.
    bounds: pydantic's ge, gt, le, lt.
    """
    extra: JsonDict = {"unit": unit, "live": live, "gauge": gauge, "option": option, "null": null}
    if isinstance(default, list):
        return Field(default_factory=lambda: list(default), description=help, json_schema_extra=extra, **bounds)
    return Field(default, description=help, json_schema_extra=extra, **bounds)


@dataclass(frozen=True)
class Knob:
    """One declared knob, as its readers need it."""

    name: str
    annotation: Any
    default: Any
    help: str
    unit: str | None
    live: bool
    gauge: bool
    option: str  # flag `--<option with dashes>`, env FERRY_<OPTION>, ServerConfig attribute
    null: str | None
    bounds: dict[str, Any]  # ge, gt, le, lt as given
    nullable: bool
    kind: type  # bool, int, float, str or list (a Literal's kind is str)
    choices: tuple[str, ...] | None  # a Literal's values

    @property
    def flag(self) -> str:
        # A list is given one item per flag: --api-key a --api-key b (env FERRY_API_KEYS=a,b).
        one = self.option[:-1] if self.kind is list and self.option.endswith("s") else self.option
        return "--" + one.replace("_", "-")

    @property
    def env(self) -> str:
        return "FERRY_" + self.option.upper()

    @property
    def gauge_name(self) -> str:
        # Base units in metric names: milliseconds are exported as seconds.
        base = self.name[: -len("_ms")] + "_seconds" if self.unit == "ms" else self.name
        return "ferry_setting_" + base

    @property
    def gauge_scale(self) -> float:
        return 1e-3 if self.unit == "ms" else 1.0

    @property
    def requirement(self) -> str:
        """What the knob accepts, in the words of a bad-setting message."""
        maybe_null = "null or " if self.nullable else ""
        if self.kind is bool:
            return "must be true or false"
        if self.choices:
            return f"must be one of {', '.join(self.choices)}"
        low, high = self.bounds.get("ge", self.bounds.get("gt")), self.bounds.get("le", self.bounds.get("lt"))
        if self.kind is int:
            if high is not None:
                return f"must be {maybe_null}an integer between {_num(low)} and {_num(high)}"
            return f"must be {maybe_null}at least {_num(low)}" if low is not None else f"must be {maybe_null}an integer"
        if self.kind is float:
            what = f"a number of {UNIT_WORDS.get(self.unit, self.unit)}" if self.unit else "a number"
            if "gt" in self.bounds:
                return f"must be {maybe_null}{what} above {_num(low)}"
            if low is not None and high is not None:
                return f"must be {maybe_null}{what} between {_num(low)} and {_num(high)}"
            return f"must be {maybe_null}{what}"
        if self.kind is list:
            return "must be a list of strings"
        return f"must be {maybe_null}a string"

    def parse(self, text: str) -> Any:
        """A value from a command-line or environment string."""
        if self.kind is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        if self.kind is bool:
            return text.lower() in ("1", "true", "yes", "on")
        if self.nullable and text.lower() in ("", "none", "null"):
            return None
        return self.kind(text)


def _num(x: Any) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@functools.cache
def knobs(model: type[BaseModel]) -> tuple[Knob, ...]:
    """The knobs a model declares, in declaration order."""
    out = []
    for name, f in model.model_fields.items():
        extra: dict[str, Any] = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        args = get_args(f.annotation)
        nullable = get_origin(f.annotation) in (Union, types.UnionType) and type(None) in args
        inner = next(a for a in args if a is not type(None)) if nullable else f.annotation
        choices = get_args(inner) if get_origin(inner) is Literal else None
        # A class for every knob type: a generic's origin (list) or the annotation itself.
        kind = cast(type, str if choices else (get_origin(inner) or inner))
        bounds = {k: getattr(m, k) for m in f.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
        out.append(
            Knob(
                name=name,
                annotation=f.annotation,
                default=f.get_default(call_default_factory=True),
                help=f.description or "",
                unit=extra.get("unit"),
                live=bool(extra.get("live")),
                gauge=bool(extra.get("gauge")),
                option=extra.get("option") or name,
                null=extra.get("null"),
                bounds=bounds,
                nullable=nullable,
                kind=kind,
                choices=choices,
            )
        )
    return tuple(out)


class Knobs(BaseModel):
    """Base of a model of declared knobs: frozen, validated at construction, and strict (a
    bool is not a number, "5" is not 5, NaN is no bound), so a bad setting fails at start
    with a `SettingsError` naming it."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise settings_error(type(self), exc) from None


def settings_error(model: type[BaseModel], exc: ValidationError) -> SettingsError:
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else "?"
    if first["type"] == "extra_forbidden":
        return SettingsError(name, "unknown setting")
    by_name = {k.name: k for k in knobs(model)}
    return SettingsError(name, by_name[name].requirement if name in by_name else first["msg"])
