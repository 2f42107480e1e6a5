"""Opaque device configuration ``gpu.flexgpu.dev/v1alpha1``: ``GpuConfig`` and ``MigConfig``.

Users put these under ``opaque.parameters`` of a claim's or a DeviceClass's ``config`` with
``driver: gpu.flexgpu.dev``. The ``sharing`` block has the shape of NVIDIA's DRA driver
(``resource.nvidia.com/v1beta1``), so a ``GpuConfig`` manifest migrates by changing only
``driver`` and ``apiVersion``. NVIDIA's MIG kind is ``MigDeviceConfig``; ours is ``MigConfig``.

``parse_opaque_config`` is the one entry point: the admission webhook and the kubelet plugin's
prepare both call it, so what admission accepts is exactly what prepare accepts. It does no I/O
and raises nothing but ``OpaqueConfigError`` for any input.

Problem texts name the field by its path from ``parameters``, the rejected value and what is
allowed::

    sharing.strategy: "Shared" is not allowed; allowed: Exclusive, TimeSlicing, MPS
    sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "10GB" is not allowed (unknown suffix
        "GB"); allowed: a Kubernetes quantity of whole bytes greater than 0, e.g. "10Gi"
    sharing.foo: unknown field; allowed: strategy, timeSlicingConfig, mpsConfig
    kind: missing; allowed: GpuConfig, MigConfig
    sharing.timeSlicingConfig: not allowed with strategy MPS; allowed: only with strategy
        TimeSlicing
    parameters: [1] is not allowed; allowed: a JSON object with apiVersion ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Annotated, Any, Final, Literal, TypeAlias, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    Strict,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from driver.gpu_model import TimeSliceInterval
from driver.names import OPAQUE_API_VERSION
from driver.quantity import INT64_MAX, Quantity, QuantityError, parse_quantity

GPU_CONFIG_KIND: Final = "GpuConfig"
MIG_CONFIG_KIND: Final = "MigConfig"
# Problems beyond this many are counted, not listed: a webhook's answer must stay readable.
MAX_PROBLEMS: Final = 20
# Nothing in either kind nests deeper than 4; deeper input is cut here before anything recurses.
_MAX_DEPTH: Final = 16
# Ints wider than this are replaced by a marker before validation: int()/str() (and so
# printing, and pydantic-core in lax mode) raise a plain ValueError beyond 4300 digits.
_MAX_INT_DIGITS: Final = 64
_MAX_INT_BITS: Final = 212  # about 64 decimal digits


class SharingStrategy(StrEnum):
    EXCLUSIVE = "Exclusive"
    TIME_SLICING = "TimeSlicing"
    MPS = "MPS"


# --------------------------------------------------------------------------- field types


def _only_str(value: object) -> object:
    # Enum fields are validated laxly (strict would want enum members from a dict), and lax
    # would also take bytes; a manifest only ever holds strings.
    if not isinstance(value, str):
        raise PydanticCustomError("flexgpu_value", "not a string", {"reason": ""})
    return value


def _memory_limit(value: object) -> Quantity:
    # int-or-string like every Kubernetes quantity field (and NVIDIA's resource.Quantity).
    if isinstance(value, Quantity):
        quantity = value
    elif isinstance(value, str):
        try:
            quantity = parse_quantity(value)
        except QuantityError as error:
            raise PydanticCustomError(
                "flexgpu_value", "{reason}", {"reason": error.reason}
            ) from None
    elif type(value) is int:
        quantity = Quantity(str(value), Fraction(value))
    else:
        raise PydanticCustomError("flexgpu_value", "not a quantity", {"reason": ""})
    if quantity.value <= 0:
        raise PydanticCustomError("flexgpu_value", "not positive", {"reason": ""})
    if not quantity.is_integer():
        reason = "not a whole number of bytes"
        raise PydanticCustomError("flexgpu_value", "{reason}", {"reason": reason})
    if quantity.value > INT64_MAX:
        reason = "more than 2^63-1 bytes"
        raise PydanticCustomError("flexgpu_value", "{reason}", {"reason": reason})
    return quantity


def _quantity_text(quantity: Quantity) -> str:
    return quantity.text


# A device index (NVIDIA's form: position among the share's devices), a published device
# name (gpu-0, gpu-0-mig-1g10gb-0) or a GPU/MIG UUID. The plugin maps them to devices.
_DEVICE_KEY = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?|(GPU|MIG)-[0-9a-fA-F-]{1,64}")


def _device_key(key: str) -> str:
    if _DEVICE_KEY.fullmatch(key) is None:
        raise PydanticCustomError("flexgpu_value", "not a device", {"reason": ""})
    return key


_QUANTITY_JSON_SCHEMA: Final[dict[str, Any]] = {
    "anyOf": [
        {
            "type": "string",
            "pattern": r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$",
        },
        {"type": "integer", "minimum": 1},
    ],
    "description": "Kubernetes quantity of bytes, greater than 0, e.g. 10Gi",
}

MemoryLimit: TypeAlias = Annotated[
    Quantity,
    PlainValidator(_memory_limit),
    PlainSerializer(_quantity_text, return_type=str),
    WithJsonSchema(_QUANTITY_JSON_SCHEMA),
]
DeviceKey: TypeAlias = Annotated[str, AfterValidator(_device_key)]
Strategy: TypeAlias = Annotated[SharingStrategy, Strict(False), BeforeValidator(_only_str)]
Interval: TypeAlias = Annotated[TimeSliceInterval, Strict(False), BeforeValidator(_only_str)]


# --------------------------------------------------------------------------- models


class _Strict(BaseModel):
    # strict: JSON 50 is a percentage; "50", 50.0 and true are not. extra="forbid": a typo in
    # a field name must fail loudly instead of silently leaving the default in place.
    # Field names are the JSON names (camelCase): aliases would make snake_case spellings
    # valid input too, or need pydantic's mypy plugin for constructor calls.
    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        frozen=True,
        field_title_generator=lambda name, _info: name,
    )


class TimeSlicingConfig(_Strict):
    """Time-slice length for the processes sharing a whole GPU."""

    interval: Interval = Field(
        default=TimeSliceInterval.DEFAULT, description="Default, Short, Medium or Long"
    )


class MpsConfig(_Strict):
    """Limits for every client of the claim's MPS control daemon."""

    defaultActiveThreadPercentage: int | None = Field(
        default=None, ge=1, le=100, description="Share of the GPU's SMs a client may use"
    )
    defaultPinnedDeviceMemoryLimit: MemoryLimit | None = Field(
        default=None, description="Device memory a client may pin, on every device"
    )
    defaultPerDevicePinnedMemoryLimit: dict[DeviceKey, MemoryLimit] | None = Field(
        default=None,
        description=(
            "Per-device override of defaultPinnedDeviceMemoryLimit, keyed by device index "
            "(0), device name (gpu-0) or UUID"
        ),
        json_schema_extra={"propertyNames": {"pattern": f"^({_DEVICE_KEY.pattern})$"}},
    )


def _conflict(field: str, detail: str, allowed: str) -> PydanticCustomError:
    ctx = {"field": field, "detail": detail, "allowed": allowed}
    return PydanticCustomError("flexgpu_conflict", "{detail}", ctx)


def _check_blocks(strategy: SharingStrategy, time_slicing: bool, mps: bool) -> None:
    """NVIDIA's rule: each settings block only with its own strategy."""
    if time_slicing and mps:
        raise _conflict(
            "",
            "timeSlicingConfig and mpsConfig together are not allowed",
            "timeSlicingConfig with strategy TimeSlicing, or mpsConfig with strategy MPS",
        )
    if time_slicing and strategy is not SharingStrategy.TIME_SLICING:
        raise _conflict(
            "timeSlicingConfig",
            f"not allowed with strategy {strategy.value}",
            "only with strategy TimeSlicing",
        )
    if mps and strategy is not SharingStrategy.MPS:
        raise _conflict(
            "mpsConfig", f"not allowed with strategy {strategy.value}", "only with strategy MPS"
        )


class GpuSharing(_Strict):
    """How the containers of a claim share a whole GPU."""

    strategy: Strategy = Field(
        default=SharingStrategy.EXCLUSIVE, description="Exclusive, TimeSlicing or MPS"
    )
    timeSlicingConfig: TimeSlicingConfig | None = None
    mpsConfig: MpsConfig | None = None

    @model_validator(mode="after")
    def _blocks_match_strategy(self) -> GpuSharing:
        _check_blocks(self.strategy, self.timeSlicingConfig is not None, self.mpsConfig is not None)
        return self


class MigSharing(_Strict):
    # No timeSlicingConfig: a MIG device has no time-slice setting (NVIDIA's MIG sharing
    # block has none either).
    """How the containers of a claim share a MIG device."""

    strategy: Strategy = Field(
        default=SharingStrategy.EXCLUSIVE, description="Exclusive, TimeSlicing or MPS"
    )
    mpsConfig: MpsConfig | None = None

    @model_validator(mode="after")
    def _blocks_match_strategy(self) -> MigSharing:
        _check_blocks(self.strategy, False, self.mpsConfig is not None)
        return self


def _require_type_meta(schema: dict[str, Any]) -> None:
    # Defaults keep Python construction short; in a manifest both fields are required.
    schema["required"] = ["apiVersion", "kind"]


class GpuConfig(_Strict):
    """Configuration of a whole GPU or a share of one (devices of gpu.flexgpu.dev and
    shared-gpu.flexgpu.dev)."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    apiVersion: Literal["gpu.flexgpu.dev/v1alpha1"] = "gpu.flexgpu.dev/v1alpha1"
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing | None = None

    @property
    def effective_sharing(self) -> GpuSharing:
        return self.sharing if self.sharing is not None else GpuSharing()

    def to_parameters(self) -> dict[str, Any]:
        return _to_parameters(self)


class MigConfig(_Strict):
    """Configuration of a MIG device (devices of mig.flexgpu.dev)."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    apiVersion: Literal["gpu.flexgpu.dev/v1alpha1"] = "gpu.flexgpu.dev/v1alpha1"
    kind: Literal["MigConfig"] = "MigConfig"
    sharing: MigSharing | None = None

    @property
    def effective_sharing(self) -> MigSharing:
        return self.sharing if self.sharing is not None else MigSharing()

    def to_parameters(self) -> dict[str, Any]:
        return _to_parameters(self)


OpaqueConfig: TypeAlias = GpuConfig | MigConfig
CONFIG_MODELS: Final[dict[str, type[GpuConfig] | type[MigConfig]]] = {
    GPU_CONFIG_KIND: GpuConfig,
    MIG_CONFIG_KIND: MigConfig,
}


def _to_parameters(config: OpaqueConfig) -> dict[str, Any]:
    """JSON-ready ``parameters`` holding what was set, always with apiVersion and kind."""
    body = config.model_dump(mode="json", exclude_unset=True)
    return {"apiVersion": config.apiVersion, "kind": config.kind, **body}


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema per kind, keyed by file name (checked in under driver/schemas/)."""
    out: dict[str, dict[str, Any]] = {}
    for kind, model in CONFIG_MODELS.items():
        schema = model.model_json_schema()
        out[f"{kind.lower()}.json"] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            **schema,
        }
    return out


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class ConfigProblem:
    """One reason a config was rejected. ``path`` holds field names and map keys from the
    root of ``parameters``; ``detail`` is the text after the path."""

    path: tuple[object, ...]
    detail: str

    def render(self, prefix: str | None = None) -> str:
        """``sharing.strategy: ...``; with ``prefix`` (e.g. ``spec.devices.config[0].opaque
        .parameters``) the path is appended to it. The root itself is ``parameters``."""
        joined = _join_path(self.path)
        if prefix is None:
            name = joined if joined and not joined.startswith("[") else "parameters" + joined
        else:
            name = prefix + ("." if joined and not joined.startswith("[") else "") + joined
        return _printable(f"{name}: {self.detail}")


class OpaqueConfigError(ValueError):
    """The parameters are not a valid config. ``problems`` holds one text per problem (at most
    ``MAX_PROBLEMS``, then a count of the rest); ``details`` the same, structured."""

    def __init__(self, details: Sequence[ConfigProblem]) -> None:
        self.details = list(details[:MAX_PROBLEMS])
        self.problems = [problem.render() for problem in self.details]
        if len(details) > MAX_PROBLEMS:
            self.problems.append(f"... and {len(details) - MAX_PROBLEMS} more problems")
        super().__init__("; ".join(self.problems))

    def render(self, prefix: str) -> list[str]:
        """The problems with their paths under ``prefix`` (see ``ConfigProblem.render``)."""
        texts = [problem.render(prefix) for problem in self.details]
        return texts + self.problems[len(self.details) :]


# --------------------------------------------------------------------------- parsing

ROOT_ALLOWED: Final = (
    f'a JSON object with apiVersion "{OPAQUE_API_VERSION}" and kind GpuConfig or MigConfig'
)
_KINDS_ALLOWED: Final = ", ".join(CONFIG_MODELS)
_QUANTITY_ALLOWED: Final = 'a Kubernetes quantity of whole bytes greater than 0, e.g. "10Gi"'
_DEVICE_KEY_ALLOWED: Final = (
    'a device index ("0"), a device name ("gpu-0") or a UUID ("GPU-...", "MIG-...")'
)
_PER_DEVICE: Final = "defaultPerDevicePinnedMemoryLimit"
# What a leaf field allows, by path; "*" stands for any map key.
_ALLOWED: Final[dict[tuple[str, ...], str]] = {
    ("apiVersion",): OPAQUE_API_VERSION,
    ("kind",): _KINDS_ALLOWED,
    ("sharing", "strategy"): ", ".join(SharingStrategy),
    ("sharing", "timeSlicingConfig", "interval"): ", ".join(TimeSliceInterval),
    ("sharing", "mpsConfig", "defaultActiveThreadPercentage"): "an integer from 1 to 100",
    ("sharing", "mpsConfig", "defaultPinnedDeviceMemoryLimit"): _QUANTITY_ALLOWED,
    ("sharing", "mpsConfig", _PER_DEVICE): 'an object of device to quantity, e.g. {"0": "4Gi"}',
    ("sharing", "mpsConfig", _PER_DEVICE, "*"): _QUANTITY_ALLOWED,
}
_UNKNOWN_FIELD_HINTS: Final[dict[tuple[str, tuple[object, ...]], str]] = {
    (MIG_CONFIG_KIND, ("sharing", "timeSlicingConfig")): (
        " (a MIG device has no time-slice interval; strategy TimeSlicing needs no settings)"
    ),
}


_MISSING: Final = object()


@dataclass(frozen=True)
class _BigInt:
    """Stands in for an integer too wide to validate or print."""

    digits: int


@dataclass(frozen=True)
class _TooDeep:
    """Stands in for data nested deeper than any field of either kind."""


def parse_opaque_config(raw: bytes | str | Mapping[str, Any]) -> OpaqueConfig:
    """Parse ``opaque.parameters`` (raw JSON bytes or text, or decoded JSON) into a config.

    Raises ``OpaqueConfigError`` listing every problem found, and nothing else, for any input.
    """
    data, problems = _load(raw)
    if problems:
        raise OpaqueConfigError(problems)
    if not isinstance(data, dict):
        raise OpaqueConfigError(
            [ConfigProblem((), f"{show_value(data)} is not allowed; allowed: {ROOT_ALLOWED}")]
        )
    kind = data.get("kind", _MISSING)
    model = CONFIG_MODELS.get(kind) if isinstance(kind, str) else None
    if "apiVersion" not in data:
        problems.append(ConfigProblem(("apiVersion",), f"missing; allowed: {OPAQUE_API_VERSION}"))
    elif model is None and data["apiVersion"] != OPAQUE_API_VERSION:
        # Without a kind there is no model to check apiVersion; report it anyway.
        problems.append(_value_problem(("apiVersion",), data["apiVersion"], OPAQUE_API_VERSION))
    if kind is _MISSING:
        problems.append(ConfigProblem(("kind",), f"missing; allowed: {_KINDS_ALLOWED}"))
    elif model is None:
        problems.append(_value_problem(("kind",), kind, _KINDS_ALLOWED))
    if model is None:
        raise OpaqueConfigError(problems)
    try:
        config = model.model_validate(data)
    except ValidationError as error:
        problems += [_translate(model, entry) for entry in error.errors()]
    if problems:
        raise OpaqueConfigError(problems)
    return config


def _load(raw: object) -> tuple[object, list[ConfigProblem]]:
    """Decode bytes and JSON text; copy decoded data into plain dicts and lists."""
    if isinstance(raw, bytes | bytearray | memoryview):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as error:
            bad = error.object[error.start]
            detail = f"invalid UTF-8 (byte 0x{bad:02x} at offset {error.start}) is not allowed"
            return None, [ConfigProblem((), f"{detail}; allowed: {ROOT_ALLOWED}")]
    if isinstance(raw, str):
        try:
            return _plain(json.loads(raw, **_JSON_OPTIONS), 0), []
        except json.JSONDecodeError as error:
            reason = f"{error.msg} at line {error.lineno} column {error.colno}"
        except RecursionError:
            reason = "nested too deeply"
        except ValueError as error:  # from our hooks: duplicate key, NaN/Infinity
            reason = str(error)
        detail = f"invalid JSON ({reason}) is not allowed; allowed: {ROOT_ALLOWED}"
        return None, [ConfigProblem((), detail)]
    return _plain(raw, 0), []


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Kubernetes' strict decoding (which NVIDIA's driver uses) rejects duplicate fields too;
    # silently taking the last one hides a typo'd manifest.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {json.dumps(key)}")
        out[key] = value
    return out


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _int_or_big(text: str) -> object:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= _MAX_INT_DIGITS else _BigInt(digits)


_JSON_OPTIONS: Final[dict[str, Any]] = {
    "object_pairs_hook": _object_without_duplicates,
    "parse_constant": _no_constants,
    "parse_int": _int_or_big,
}


def _plain(value: object, depth: int) -> object:
    """A copy of decoded data as dicts, lists and scalars, with too-wide ints and too-deep
    nesting replaced by markers, so that validation and printing can never blow up."""
    if depth > _MAX_DEPTH:
        return _TooDeep()
    if isinstance(value, str):
        # pydantic-core cannot read lone surrogates (JSON allows "\ud800") and gives up on the
        # whole object; no valid value holds one, so escaping changes no verdict.
        return _printable(value)
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        bits = value.bit_length()
        return value if bits <= _MAX_INT_BITS else _BigInt(int(bits * 0.30103) + 1)
    if isinstance(value, Mapping):
        # Keys stay as they are (a list is no dict key), except ints too wide to print.
        return {
            (_plain(k, depth) if type(k) in (int, str) else k): _plain(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_plain(item, depth + 1) for item in value]
    return value


def _translate(model: type[BaseModel], entry: Mapping[str, Any]) -> ConfigProblem:
    """One pydantic error as a problem that names field, value and what is allowed."""
    loc: tuple[object, ...] = tuple(entry["loc"])
    kind = model.model_fields["kind"].default
    error_type = entry["type"]
    ctx = entry.get("ctx") or {}
    if error_type in ("extra_forbidden", "invalid_key"):
        parent = _model_at(model, loc[:-1])
        fields = ", ".join(parent.model_fields) if parent is not None else ""
        hint = _UNKNOWN_FIELD_HINTS.get((kind, loc), "")
        return ConfigProblem(loc, f"unknown field{hint}; allowed: {fields}")
    if loc and loc[-1] == "[key]":
        detail = f"key {show_value(loc[-2])} is not allowed; allowed: {_DEVICE_KEY_ALLOWED}"
        return ConfigProblem(loc[:-2], detail)
    if error_type == "flexgpu_conflict":
        path = loc + ((ctx["field"],) if ctx["field"] else ())
        return ConfigProblem(path, f"{ctx['detail']}; allowed: {ctx['allowed']}")
    allowed = _allowed(model, loc)
    if error_type == "missing":
        return ConfigProblem(loc, f"missing; allowed: {allowed}")
    reason = ctx.get("reason", "") if error_type == "flexgpu_value" else ""
    return _value_problem(loc, entry.get("input"), allowed, reason)


def _value_problem(
    path: tuple[object, ...], value: object, allowed: str, reason: str = ""
) -> ConfigProblem:
    because = f" ({reason})" if reason else ""
    return ConfigProblem(path, f"{show_value(value)} is not allowed{because}; allowed: {allowed}")


def _model_at(model: type[BaseModel], loc: Sequence[object]) -> type[BaseModel] | None:
    current: type[BaseModel] | None = model
    for segment in loc:
        if current is None or not isinstance(segment, str):
            return None
        field = current.model_fields.get(segment)
        if field is None:
            return None
        candidates = (field.annotation, *get_args(field.annotation))
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return current


def _allowed(model: type[BaseModel], loc: tuple[object, ...]) -> str:
    target = _model_at(model, loc)
    if target is not None:
        return "an object with fields " + ", ".join(target.model_fields)
    pattern = tuple(
        "*" if index > 0 and loc[index - 1] == _PER_DEVICE else str(segment)
        for index, segment in enumerate(loc)
    )
    return _ALLOWED.get(pattern, "see the JSON Schema of " + str(model.__name__))


# --------------------------------------------------------------------------- printing

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHOW_LIMIT: Final = 60


def _join_path(path: Sequence[object]) -> str:
    out = ""
    for segment in path:
        if isinstance(segment, str) and _IDENTIFIER.fullmatch(segment):
            out += f".{segment}" if out else segment
        else:
            out += f"[{show_value(segment)}]"
    return out


def show_value(value: object) -> str:
    """A short JSON-like rendering of a rejected value."""
    text = _render(value, 0)
    return _printable(text if len(text) <= _SHOW_LIMIT else text[: _SHOW_LIMIT - 3] + "...")


def _render(value: object, depth: int) -> str:
    if depth > _MAX_DEPTH + 2:
        return "..."
    if isinstance(value, _BigInt):
        return f"a {value.digits}-digit integer"
    if isinstance(value, _TooDeep):
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


def _printable(text: str) -> str:
    # Lone surrogates (legal in JSON "\ud800" escapes) cannot be encoded for a gRPC status
    # or an admission response; escape them.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
