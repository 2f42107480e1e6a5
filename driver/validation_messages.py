"""Problem texts for every model users write (opaque config, GpuNodePolicy): each rejection
names the field by its path, the rejected value and what is allowed::

    sharing.strategy: "Shared" is not allowed; allowed: Exclusive, TimeSlicing, MPS
    spec.gpus[0].migLayout: not allowed with mode Whole; allowed: only with mode MIG
    spec.nodeSelector.matchLabels: key "a b" is not allowed; allowed: a label key: ...
    sharing.foo: unknown field; allowed: strategy, timeSlicingConfig, mpsConfig

Each model family brings a ``MessageRules`` (its root model, what each path allows, what each
map's keys allow); ``translate`` turns one pydantic error into a ``Problem`` with it. Validators
raise ``value_error`` (a bad value, with an optional reason in parentheses) or ``conflict`` (two
fields that do not go together). ``plain_copy`` makes any decoded input safe to validate and
to print. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import NoneType, UnionType
from typing import Annotated, Any, Final, Generic, TypeAlias, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

__all__ = [
    "MAX_DEPTH",
    "MAX_PROBLEMS",
    "BigInt",
    "MapKey",
    "MessageRules",
    "Pattern",
    "Problem",
    "ProblemsError",
    "StrictModel",
    "TooDeep",
    "conflict",
    "join_path",
    "nested",
    "only_str",
    "plain_copy",
    "printable",
    "show_value",
    "translate",
    "value_detail",
    "value_error",
]

# Problems beyond this many are counted, not listed: a webhook's answer must stay readable.
MAX_PROBLEMS: Final = 20
# No model nests deeper than this; deeper input is cut here before anything recurses.
MAX_DEPTH: Final = 16
# Ints wider than this are replaced by a marker before validation: int()/str() (and so
# printing, and pydantic-core in lax mode) raise a plain ValueError beyond 4300 digits.
_MAX_INT_BITS: Final = 212  # about 64 decimal digits
_SHOW_LIMIT: Final = 60

# pydantic error types our validators raise (see value_error and conflict).
_VALUE: Final = "flexgpu_value"
_CONFLICT: Final = "flexgpu_conflict"


class StrictModel(BaseModel):
    """Base of every model users write.

    strict: JSON 50 is a number; "50", 50.0 and true are not. extra="forbid": a typo in a field
    name must fail loudly instead of silently leaving the default in place. Field names are the
    JSON names (camelCase): aliases would make snake_case spellings valid input too, or need
    pydantic's mypy plugin for constructor calls."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        frozen=True,
        field_title_generator=lambda name, _info: name,
        # Validators are built on first use: a node without claim configs or node policies
        # never needs theirs (about 1 MiB of the plugin's memory).
        defer_build=True,
    )


# --------------------------------------------------------------------------- raising


def value_error(reason: str = "", summary: str = "") -> PydanticCustomError:
    """A rejected value; a non-empty ``reason`` is shown in parentheses after the value.
    ``summary`` is only pydantic's own text (never shown to users)."""
    return PydanticCustomError(_VALUE, summary or "{reason}", {"reason": reason})


def conflict(field_name: str, detail: str, allowed: str) -> PydanticCustomError:
    """Fields that do not go together, raised by a model validator: the problem's path is
    the model's plus ``field_name`` (none when empty)."""
    ctx = {"field": field_name, "detail": detail, "allowed": allowed}
    return PydanticCustomError(_CONFLICT, "{detail}", ctx)


def only_str(value: object) -> object:
    """Before-validator of enum fields. They validate laxly (strict wants enum members from a
    dict), and lax would also take bytes; a manifest only ever holds strings."""
    if not isinstance(value, str):
        raise value_error(summary="not a string")
    return value


# --------------------------------------------------------------------------- input


@dataclass(frozen=True)
class BigInt:
    """Stands in for an integer too wide to validate or print."""

    digits: int


@dataclass(frozen=True)
class TooDeep:
    """Stands in for data nested deeper than any model's fields."""


def plain_copy(value: object, depth: int = 0) -> object:
    """A copy of decoded data as dicts, lists and scalars, with too-wide ints and too-deep
    nesting replaced by markers, so that validation and printing can never blow up."""
    if depth > MAX_DEPTH:
        return TooDeep()
    if isinstance(value, str):
        # pydantic-core cannot read lone surrogates (JSON allows "\ud800") and gives up on the
        # whole object; no valid value holds one, so escaping changes no verdict.
        return printable(value)
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        bits = value.bit_length()
        return value if bits <= _MAX_INT_BITS else BigInt(int(bits * 0.30103) + 1)
    if isinstance(value, Mapping):
        # Keys stay as they are (a list is no dict key), except ints too wide to print.
        return {
            (plain_copy(k, depth) if type(k) in (int, str) else k): plain_copy(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [plain_copy(item, depth + 1) for item in value]
    return value


# --------------------------------------------------------------------------- printing


def printable(text: str) -> str:
    """``text`` with lone surrogates (legal in JSON "\\ud800" escapes) escaped: they cannot be
    encoded for a gRPC status or an admission response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def show_value(value: object) -> str:
    """A short JSON-like rendering of a rejected value."""
    text = _render(value, 0)
    return printable(text if len(text) <= _SHOW_LIMIT else text[: _SHOW_LIMIT - 3] + "...")


def _render(value: object, depth: int) -> str:
    if depth > MAX_DEPTH + 2:
        return "..."
    if isinstance(value, BigInt):
        return f"a {value.digits}-digit integer"
    if isinstance(value, TooDeep):
        return "..."
    if value is None or isinstance(value, bool | str | float):
        # json.dumps writes NaN and Infinity for such floats; they are never valid anyway.
        return json.dumps(
            value if not isinstance(value, str) else value[:_SHOW_LIMIT], ensure_ascii=False
        )
    if isinstance(value, int):
        return str(value) if value.bit_length() <= _MAX_INT_BITS else "a very large integer"
    if isinstance(value, dict):
        items = list(value.items())[:_SHOW_LIMIT]
        inner = ", ".join(f"{_render(k, depth + 1)}: {_render(v, depth + 1)}" for k, v in items)
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_render(item, depth + 1) for item in value[:_SHOW_LIMIT]) + "]"
    if isinstance(value, BaseModel):
        return "an object"
    return f"a {type(value).__name__}"


class MapKey(str):
    """A map key in a problem's path: always shown in brackets, ``migLayout["1g.10gb"]``, even
    when it looks like a field name."""

    __slots__ = ()


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def join_path(path: Sequence[object]) -> str:
    """``spec.gpus[0].migLayout["1g.10gb"]``: fields dotted, indices and keys in brackets."""
    out = ""
    for segment in path:
        if isinstance(segment, int) and not isinstance(segment, bool):
            out += f"[{segment}]"
        elif (
            isinstance(segment, str)
            and not isinstance(segment, MapKey)
            and _IDENTIFIER.fullmatch(segment)
        ):
            out += f".{segment}" if out else segment
        else:
            out += f"[{show_value(segment)}]"
    return out


def value_detail(value: object, allowed: str, reason: str = "") -> str:
    """``"x" is not allowed (reason); allowed: ...``"""
    because = f" ({reason})" if reason else ""
    return f"{show_value(value)} is not allowed{because}; allowed: {allowed}"


# --------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """One reason an object was rejected: ``path`` holds field names, list indices and map
    keys (``MapKey``) from the object's root; ``detail`` is the text after the path."""

    path: tuple[object, ...]
    detail: str

    def render(self) -> str:
        return printable(f"{join_path(self.path) or 'object'}: {self.detail}")


P = TypeVar("P", bound=Problem)


class ProblemsError(ValueError, Generic[P]):
    """Every problem of one object. ``problems`` holds one text per problem (at most
    ``MAX_PROBLEMS``, then a count of the rest); ``details`` the same, structured. Exact
    repeats are dropped."""

    def __init__(self, details: Sequence[P]) -> None:
        unique = _unique(details)
        self.details: list[P] = unique[:MAX_PROBLEMS]
        self.problems = [problem.render() for problem in self.details]
        if len(unique) > MAX_PROBLEMS:
            self.problems.append(f"... and {len(unique) - MAX_PROBLEMS} more problems")
        super().__init__("; ".join(self.problems))


def _unique(problems: Sequence[P]) -> list[P]:
    # pydantic reports in field order already; keep it.
    seen: set[tuple[tuple[str, ...], str]] = set()
    out = []
    for problem in problems:
        key = (tuple(repr(p) for p in problem.path), problem.detail)
        if key not in seen:
            seen.add(key)
            out.append(problem)
    return out


# --------------------------------------------------------------------------- translating

Pattern: TypeAlias = tuple[str, ...]


def nested(prefix: Pattern, table: Mapping[Pattern, str]) -> dict[Pattern, str]:
    """``table`` (patterns inside a block) with its patterns moved under ``prefix``: where a
    model embeds another family's block, it reuses that family's texts."""
    return {(*prefix, *pattern): text for pattern, text in table.items()}


@dataclass(frozen=True)
class MessageRules:
    """What a model family allows, for its problem texts. Patterns are paths with every list
    index and map key as ``"*"``.

    ``allowed``: by pattern, what the value there allows (looked up first). Elsewhere a
    nested model allows "an object with fields ..."; anything else gets ``fallback``.
    ``keys_allowed``: by the pattern of a map, what its keys allow (default "a string").
    ``unknown_field_hints``: by the pattern of an unknown field, a hint appended to
    "unknown field"."""

    model: type[BaseModel]
    allowed: Mapping[Pattern, str]
    fallback: str
    keys_allowed: Mapping[Pattern, str] = field(default_factory=dict)
    unknown_field_hints: Mapping[Pattern, str] = field(default_factory=dict)


def translate(rules: MessageRules, entry: Mapping[str, Any], kind: type[P]) -> P:
    """One pydantic error (an item of ``ValidationError.errors()``) as a problem of ``kind``
    that names the field, the value and what is allowed."""
    path, detail = _path_and_detail(rules, entry)
    return kind(path, detail)


def _path_and_detail(
    rules: MessageRules, entry: Mapping[str, Any]
) -> tuple[tuple[object, ...], str]:
    loc = _mark_keys(rules.model, tuple(entry["loc"]))
    error_type = entry["type"]
    ctx = entry.get("ctx") or {}
    if error_type in ("extra_forbidden", "invalid_key"):
        parent = _walk(rules.model, loc[:-1])[1]
        fields = (
            ", ".join(parent.model_fields)
            if isinstance(parent, type) and issubclass(parent, BaseModel)
            else ""
        )
        hint = rules.unknown_field_hints.get(_walk(rules.model, loc)[0], "")
        return loc, f"unknown field{hint}; allowed: {fields}"
    if loc and loc[-1] == "[key]":
        allowed = rules.keys_allowed.get(_walk(rules.model, loc[:-2])[0], "a string")
        return loc[:-2], f"key {show_value(loc[-2])} is not allowed; allowed: {allowed}"
    if error_type == _CONFLICT:
        path = loc + ((ctx["field"],) if ctx["field"] else ())
        return path, f"{ctx['detail']}; allowed: {ctx['allowed']}"
    allowed = _allowed(rules, loc)
    if error_type == "missing":
        return loc, f"missing; allowed: {allowed}"
    reason = ctx.get("reason", "") if error_type == _VALUE else ""
    return loc, value_detail(entry.get("input"), allowed, reason)


def _allowed(rules: MessageRules, loc: Sequence[object]) -> str:
    pattern, found = _walk(rules.model, loc)
    if pattern in rules.allowed:
        return rules.allowed[pattern]
    if isinstance(found, type) and issubclass(found, BaseModel):
        return "an object with fields " + ", ".join(found.model_fields)
    return rules.fallback


def _unwrap(annotation: object) -> object:
    """The type inside Annotated[...] and X | None."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, UnionType):
            members = [arg for arg in get_args(annotation) if arg is not NoneType]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _walk(model: type[BaseModel], loc: Sequence[object]) -> tuple[Pattern, object]:
    """The path as a pattern (list indices and map keys as "*"), and the type found there
    (None when the path leaves the model)."""
    current: object = model
    pattern: list[str] = []
    for segment in loc:
        current = _unwrap(current)
        origin = get_origin(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(segment) if isinstance(segment, str) else None
            if info is None:
                return (*pattern, str(segment)), None
            pattern.append(str(segment))
            current = info.annotation
        elif origin is dict:
            pattern.append("*")
            current = get_args(current)[1]
        elif origin is list:
            pattern.append("*")
            current = get_args(current)[0]
        else:
            return (*pattern, str(segment)), None
    return tuple(pattern), _unwrap(current)


def _mark_keys(model: type[BaseModel], loc: Sequence[object]) -> tuple[object, ...]:
    """``loc`` with the segments that are map keys as ``MapKey``."""
    current: object = model
    out: list[object] = []
    for position, segment in enumerate(loc):
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(segment) if isinstance(segment, str) else None
            if info is None:
                return (*out, *loc[position:])
            current = info.annotation
            out.append(segment)
        elif get_origin(current) is dict and isinstance(segment, str):
            current = get_args(current)[1]
            out.append(MapKey(segment))
        elif get_origin(current) is list:
            current = get_args(current)[0]
            out.append(segment)
        else:
            return (*out, *loc[position:])
    return tuple(out)
