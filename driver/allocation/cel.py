"""CEL device selectors, evaluated as the scheduler does (on ``cel-python``, module ``celpy``).

The single variable is ``device``: ``driver``, ``allowMultipleAllocations``, ``attributes`` and
``capacity``, the last two as maps from domain to maps from name to value. An unqualified
attribute or capacity of a device lives under its driver's domain. Looking up a domain the device
does not have yields an empty map (so ``"x" in device.attributes["other.dev"]`` is false), while
looking up a missing name inside a domain is a runtime error, as in the scheduler.

The Kubernetes extension libraries that selectors use are provided as functions: quantity
(``quantity``, ``isQuantity``, ``sign``, ``compareTo``, ``isGreaterThan``, ``isLessThan``, ``add``,
``sub``, ``asInteger``, ``isInteger``, ``asApproximateFloat``), semver (``semver``, ``isSemver``,
``major``, ``minor``, ``patch`` and the comparisons) and the string extensions (``lowerAscii``,
``upperAscii``, ``split``, ``join``, ``substring``, ``charAt``, ``indexOf``, ``lastIndexOf``,
``replace``, ``trim``, ``reverse``) with regex ``find``/``findAll``. Not supported: optional
syntax (``.?x``, ``orValue``), which celpy's parser lacks; such a selector reports a compile error.

A runtime error is not "no match": the scheduler aborts the whole scheduling attempt for the pod
when a selector fails on a device it evaluates, so evaluation raises ``SelectorError`` and the
allocator turns it into a verdict of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

import celpy
from celpy import celtypes

from flexgpu.driver.allocation.model import AttributeValue, Device
from flexgpu.driver.allocation.semver import Semver, SemverError, normalize_semver, parse_semver
from flexgpu.driver.quantity import INT64_MAX, QuantityError, parse_quantity


class SelectorError(Exception):
    """A selector failed to compile or to evaluate on a device."""

    def __init__(self, expression: str, message: str, *, compile_error: bool = False) -> None:
        super().__init__(message)
        self.expression = expression
        self.message = message
        self.compile_error = compile_error


@dataclass(frozen=True)
class CelQuantity:
    """A quantity value inside CEL; equality and ordering are numeric (``1Gi == 1024Mi``)."""

    value: Fraction

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelQuantity) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def qualify(name: str, driver: str) -> tuple[str, str]:
    """``domain/id`` -> (domain, id); an unqualified name belongs to the device's driver."""
    domain, sep, ident = name.partition("/")
    return (domain, ident) if sep else (driver, name)


# --- functions ---------------------------------------------------------------------------------


def _str(value: Any, fn: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{fn}: expected a string, got {type(value).__name__}")
    return str(value)


def _q(value: Any, fn: str) -> CelQuantity:
    if not isinstance(value, CelQuantity):
        raise TypeError(f"{fn}: expected a quantity, got {type(value).__name__}")
    return value


def _int64(value: Fraction, fn: str) -> celtypes.IntType:
    if value.denominator != 1 or not -INT64_MAX - 1 <= value.numerator <= INT64_MAX:
        raise ValueError(f"{fn}: cannot convert value to integer")
    return celtypes.IntType(value.numerator)


def _quantity(text: Any) -> CelQuantity:
    try:
        return CelQuantity(parse_quantity(_str(text, "quantity")).value)
    except QuantityError as err:
        raise ValueError(str(err)) from err


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        parse_quantity(_str(text, "isQuantity"))
    except QuantityError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _semver(text: Any, normalize: Any = False) -> Semver:
    parse = normalize_semver if bool(normalize) else parse_semver
    try:
        return parse(_str(text, "semver"))
    except SemverError as err:
        raise ValueError(str(err)) from err


def _is_semver(text: Any, normalize: Any = False) -> celtypes.BoolType:
    try:
        _semver(text, normalize)
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _compare(a: Any, b: Any, fn: str) -> int:
    if isinstance(a, Semver) and isinstance(b, Semver):
        return a.compare(b)
    qa, qb = _q(a, fn), _q(b, fn)
    return (qa.value > qb.value) - (qa.value < qb.value)


def _arith(a: Any, b: Any, sign: int, fn: str) -> CelQuantity:
    base = _q(a, fn).value
    if isinstance(b, CelQuantity):
        return CelQuantity(base + sign * b.value)
    if isinstance(b, int) and not isinstance(b, bool):
        return CelQuantity(base + sign * int(b))
    raise TypeError(f"{fn}: expected a quantity or an int")


def _semver_part(index: int, fn: str) -> Callable[[Any], celtypes.IntType]:
    def part(v: Any) -> celtypes.IntType:
        if not isinstance(v, Semver):
            raise TypeError(f"{fn}: expected a semver")
        return celtypes.IntType((v.major, v.minor, v.patch)[index])

    return part


def _index_of(haystack: Any, needle: Any, start: Any = 0) -> celtypes.IntType:
    if isinstance(haystack, list):
        for i, item in enumerate(haystack):
            if item == needle:
                return celtypes.IntType(i)
        return celtypes.IntType(-1)
    text, sub = _str(haystack, "indexOf"), _str(needle, "indexOf")
    if not 0 <= int(start) <= len(text):
        raise ValueError("indexOf: index out of range")
    return celtypes.IntType(text.find(sub, int(start)))


def _last_index_of(haystack: Any, needle: Any, end: Any = None) -> celtypes.IntType:
    if isinstance(haystack, list):
        for i in range(len(haystack) - 1, -1, -1):
            if haystack[i] == needle:
                return celtypes.IntType(i)
        return celtypes.IntType(-1)
    text, sub = _str(haystack, "lastIndexOf"), _str(needle, "lastIndexOf")
    stop = len(text) if end is None else int(end)
    if not 0 <= stop <= len(text):
        raise ValueError("lastIndexOf: index out of range")
    return celtypes.IntType(text.rfind(sub, 0, stop + len(sub)))


def _substring(text: Any, start: Any, end: Any = None) -> celtypes.StringType:
    s = _str(text, "substring")
    stop = len(s) if end is None else int(end)
    if not 0 <= int(start) <= stop <= len(s):
        raise ValueError("substring: index out of range")
    return celtypes.StringType(s[int(start) : stop])


def _char_at(text: Any, index: Any) -> celtypes.StringType:
    s = _str(text, "charAt")
    if not 0 <= int(index) <= len(s):
        raise ValueError("charAt: index out of range")
    return celtypes.StringType(s[int(index) : int(index) + 1])


def _split(text: Any, sep: Any, limit: Any = -1) -> celtypes.ListType:
    s, d, n = _str(text, "split"), _str(sep, "split"), int(limit)
    if n == 0:
        return celtypes.ListType([])
    parts = s.split(d, n - 1) if n > 0 else s.split(d)
    return celtypes.ListType([celtypes.StringType(p) for p in parts])


def _join(items: Any, sep: Any = "") -> celtypes.StringType:
    if not isinstance(items, list):
        raise TypeError("join: expected a list of strings")
    return celtypes.StringType(_str(sep, "join").join(_str(i, "join") for i in items))


def _replace(text: Any, old: Any, new: Any, limit: Any = -1) -> celtypes.StringType:
    s = _str(text, "replace")
    return celtypes.StringType(s.replace(_str(old, "replace"), _str(new, "replace"), int(limit)))


def _find(text: Any, pattern: Any) -> celtypes.StringType:
    found = re.search(_str(pattern, "find"), _str(text, "find"))
    return celtypes.StringType(found.group(0) if found else "")


def _find_all(text: Any, pattern: Any, limit: Any = -1) -> celtypes.ListType:
    matches = [m.group(0) for m in re.finditer(_str(pattern, "findAll"), _str(text, "findAll"))]
    if int(limit) >= 0:
        matches = matches[: int(limit)]
    return celtypes.ListType([celtypes.StringType(m) for m in matches])


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "sign": lambda q: celtypes.IntType((_q(q, "sign").value > 0) - (q.value < 0)),
    "isInteger": lambda q: celtypes.BoolType(
        _q(q, "isInteger").value.denominator == 1 and abs(q.value) <= INT64_MAX
    ),
    "asInteger": lambda q: _int64(_q(q, "asInteger").value, "asInteger"),
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(_q(q, "asApproximateFloat").value)),
    "add": lambda a, b: _arith(a, b, 1, "add"),
    "sub": lambda a, b: _arith(a, b, -1, "sub"),
    "compareTo": lambda a, b: celtypes.IntType(_compare(a, b, "compareTo")),
    "isGreaterThan": lambda a, b: celtypes.BoolType(_compare(a, b, "isGreaterThan") > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_compare(a, b, "isLessThan") < 0),
    "semver": _semver,
    "isSemver": _is_semver,
    "major": _semver_part(0, "major"),
    "minor": _semver_part(1, "minor"),
    "patch": _semver_part(2, "patch"),
    "lowerAscii": lambda s: celtypes.StringType(_str(s, "lowerAscii").lower()),
    "upperAscii": lambda s: celtypes.StringType(_str(s, "upperAscii").upper()),
    "trim": lambda s: celtypes.StringType(_str(s, "trim").strip()),
    "reverse": lambda s: celtypes.StringType(_str(s, "reverse")[::-1]),
    "split": _split,
    "join": _join,
    "substring": _substring,
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "replace": _replace,
    "find": _find,
    "findAll": _find_all,
}


# --- compilation and evaluation -------------------------------------------------------------------

_ENV = celpy.Environment()


@dataclass(frozen=True)
class CompiledSelector:
    expression: str
    program: Any | None  # celpy Runner; None when compilation failed
    error: str | None


@lru_cache(maxsize=4096)
def compile_selector(expression: str) -> CompiledSelector:
    """Compiled once per distinct expression: parsing dominates celpy's cost."""
    try:
        program = _ENV.program(_ENV.compile(expression), functions=FUNCTIONS)
    except Exception as err:  # celpy raises its own parse errors and Lark's
        return CompiledSelector(expression, None, f"compile error: {err}")
    return CompiledSelector(expression, program, None)


class _DomainMap(celtypes.MapType):
    """Outer ``attributes`` / ``capacity`` map: an unknown domain reads as an empty map."""

    def __getitem__(self, key: Any) -> Any:
        if super().__contains__(key):
            return super().__getitem__(key)
        return celtypes.MapType({})


def _attribute_value(attr: AttributeValue) -> Any:
    if attr.kind == "int":
        return celtypes.IntType(attr.value)
    if attr.kind == "bool":
        return celtypes.BoolType(attr.value)
    if attr.kind == "string":
        return celtypes.StringType(attr.value)
    if attr.kind == "version":
        return parse_semver(str(attr.value))
    element = {"ints": celtypes.IntType, "bools": celtypes.BoolType, "strings": celtypes.StringType}
    if attr.kind in element:
        return celtypes.ListType([element[attr.kind](v) for v in attr.value])
    versions: list[Any] = [parse_semver(str(v)) for v in attr.value]
    return celtypes.ListType(versions)


def _nested(values: Mapping[str, Any], driver: str) -> _DomainMap:
    domains: dict[str, dict[Any, Any]] = {}
    for name, value in values.items():
        domain, ident = qualify(name, driver)
        domains.setdefault(domain, {})[celtypes.StringType(ident)] = value
    return _DomainMap(
        {celtypes.StringType(d): celtypes.MapType(inner) for d, inner in domains.items()}
    )


def device_activation(driver: str, device: Device) -> dict[str, Any]:
    """The ``device`` variable for one device of ``driver``'s slice."""
    try:
        attributes = {k: _attribute_value(v) for k, v in device.attributes.items()}
    except SemverError as err:
        # The scheduler fails the same way: a version attribute it cannot parse is an error.
        raise SelectorError("", f"device {device.name}: {err}") from err
    capacity = {k: CelQuantity(v.value) for k, v in device.capacity.items()}
    return {
        "device": celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(driver),
                celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
                    device.allow_multiple_allocations
                ),
                celtypes.StringType("attributes"): _nested(attributes, driver),
                celtypes.StringType("capacity"): _nested(capacity, driver),
            }
        )
    }


def evaluate(expression: str, activation: Mapping[str, Any]) -> bool:
    """True or False; raises ``SelectorError`` on a compile or runtime error."""
    compiled = compile_selector(expression)
    if compiled.program is None:
        raise SelectorError(expression, compiled.error or "compile error", compile_error=True)
    try:
        result = compiled.program.evaluate(dict(activation))
    except celpy.CELEvalError as err:
        raise SelectorError(expression, _describe(err)) from err
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise SelectorError(expression, str(err)) from err
    if isinstance(result, celpy.CELEvalError):
        raise SelectorError(expression, _describe(result))
    if not isinstance(result, celtypes.BoolType | bool):
        raise SelectorError(expression, f"result is {type(result).__name__}, not bool")
    return bool(result)


def _describe(err: BaseException) -> str:
    args = err.args
    if args and isinstance(args[0], str):
        message = args[0]
        if "no such" in message and len(args) > 2 and args[2]:
            return f"{message}: {args[2][0]!r}"
        return message
    return str(err)


# --- what an expression reads of the device ------------------------------------------------

# `device.attributes["domain"].id`, `device.capacity["domain"].id` (not a method call such as
# `.exists(...)`), `device.driver` and `device.allowMultipleAllocations`.
_FIELD = re.compile(
    r"""\bdevice\s*\.\s*(?:
        (?P<collection>attributes|capacity)\s*\[\s*(?:"(?P<dq>[^"\\]*)"|'(?P<sq>[^'\\]*)')\s*\]
        \s*\.\s*(?P<ident>[A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\()
      | (?P<plain>driver|allowMultipleAllocations)\b(?!\s*\()
    )""",
    re.VERBOSE,
)
_DEVICE_WORD = re.compile(r"\bdevice\b")

DeviceField = tuple[str, str, str]  # (collection, domain, id), or (name, "", "") for plain fields


@lru_cache(maxsize=4096)
def device_fields(expression: str) -> tuple[DeviceField, ...] | None:
    """The device fields an expression reads, when it reads the device only through
    ``device.attributes[<domain>].<id>``, ``device.capacity[<domain>].<id>``, ``device.driver``
    and ``device.allowMultipleAllocations``; None when it uses the device any other way (a whole
    map, an index by variable, a macro over a domain), so nothing can be said from the fields.

    CEL is deterministic: two devices that agree on every field an expression reads (and on
    which attribute/capacity domains exist) get the same result, so a caller may evaluate once
    per distinct set of values instead of once per device."""
    found: list[DeviceField] = []

    def take(match: re.Match[str]) -> str:
        if match.group("plain"):
            found.append((match.group("plain"), "", ""))
        else:
            domain = match.group("dq") if match.group("dq") is not None else match.group("sq")
            found.append((match.group("collection"), domain or "", match.group("ident")))
        return " "

    rest = _FIELD.sub(take, expression)
    if _DEVICE_WORD.search(rest):
        return None
    return tuple(dict.fromkeys(found))


_MISSING = ("missing",)


@dataclass(frozen=True)
class DeviceTable:
    """A device's fields by (domain, id), as ``field_values`` reads them."""

    driver: str
    multiple: bool
    attributes: Mapping[tuple[str, str], object]
    capacity: Mapping[tuple[str, str], object]
    attribute_domains: frozenset[str]
    capacity_domains: frozenset[str]


def device_table(driver: str, device: Device) -> DeviceTable:
    attributes = {qualify(k, driver): (v.kind, v.value) for k, v in device.attributes.items()}
    capacity = {qualify(k, driver): v.value for k, v in device.capacity.items()}
    return DeviceTable(
        driver,
        device.allow_multiple_allocations,
        attributes,
        capacity,
        frozenset(d for d, _ in attributes),
        frozenset(d for d, _ in capacity),
    )


def field_values(fields: tuple[DeviceField, ...], table: DeviceTable) -> tuple[object, ...]:
    """The values ``fields`` take on the device, with the domains present in each collection
    that is read (an absent domain and an absent id may differ in CEL)."""
    values: list[object] = []
    collections: set[str] = set()
    for collection, domain, ident in fields:
        if collection == "driver":
            values.append(table.driver)
        elif collection == "allowMultipleAllocations":
            values.append(table.multiple)
        else:
            collections.add(collection)
            source = table.attributes if collection == "attributes" else table.capacity
            values.append(source.get((domain, ident), _MISSING))
    if "attributes" in collections:
        values.append(table.attribute_domains)
    if "capacity" in collections:
        values.append(table.capacity_domains)
    return tuple(values)


def versions_parse(device: Device) -> bool:
    """False when a version attribute would fail the device's activation (an error for every
    expression, which must stay the device's own)."""
    try:
        for attr in device.attributes.values():
            if attr.kind in ("version", "versions"):
                _attribute_value(attr)
    except SemverError:
        return False
    return True
