"""Opaque device configuration ``gpu.flexgpu.dev/v1alpha1``: ``GpuConfig`` and ``MigConfig``.

Users put these under ``opaque.parameters`` of a claim's or a DeviceClass's ``config`` with
``driver: gpu.flexgpu.dev``. The ``sharing`` block has the shape of NVIDIA's DRA driver
(``resource.nvidia.com/v1beta1``), so a ``GpuConfig`` manifest migrates by changing only
``driver`` and ``apiVersion``. NVIDIA's MIG kind ``MigDeviceConfig`` is read as ``MigConfig``
(the parsed config keeps the kind it was written with). ``GpuConfig`` also takes a ``share``
block of flexgpu's own (``driver.share_config``: a burstable fraction's ``computeLimit``).

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
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Annotated, Any, Final, Literal, TypeAlias

from pydantic import (
    AfterValidator,
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

from flexgpu.driver.gpu_model import TimeSliceInterval
from flexgpu.driver.names import OPAQUE_API_VERSION
from flexgpu.driver.quantity import INT64_MAX, Quantity, QuantityError, parse_quantity
from flexgpu.driver.share_config import COMPUTE_LIMIT_ALLOWED, ShareConfig
from flexgpu.driver.strict_json import strict_json_loads
from flexgpu.driver.validation_messages import (
    MAX_PROBLEMS,
    MessageRules,
    Pattern,
    Problem,
    ProblemsError,
    StrictModel,
    conflict,
    join_path,
    nested,
    only_str,
    plain_copy,
    printable,
    show_value,
    translate,
    value_detail,
    value_error,
)

# MAX_PROBLEMS and show_value are re-exported: callers count problems and print values the
# same way as this module does.
__all__ = [
    "CONFIG_MODELS",
    "GPU_CONFIG_KIND",
    "MAX_PROBLEMS",
    "MIG_CONFIG_KIND",
    "MIG_DEVICE_CONFIG_KIND",
    "ROOT_ALLOWED",
    "SHARING_ALLOWED",
    "SHARING_KEYS_ALLOWED",
    "ConfigProblem",
    "DeviceKey",
    "GpuConfig",
    "GpuSharing",
    "Interval",
    "MemoryLimit",
    "MigConfig",
    "MigSharing",
    "MpsConfig",
    "OpaqueConfig",
    "OpaqueConfigError",
    "ShareConfig",
    "SharingStrategy",
    "Strategy",
    "TimeSlicingConfig",
    "json_schemas",
    "parse_opaque_config",
    "show_value",
]

GPU_CONFIG_KIND: Final = "GpuConfig"
MIG_CONFIG_KIND: Final = "MigConfig"
# NVIDIA's DRA driver names its MIG kind so; a migrated manifest keeps it.
MIG_DEVICE_CONFIG_KIND: Final = "MigDeviceConfig"


class SharingStrategy(StrEnum):
    EXCLUSIVE = "Exclusive"
    TIME_SLICING = "TimeSlicing"
    MPS = "MPS"


# --------------------------------------------------------------------------- field types


def _memory_limit(value: object) -> Quantity:
    # int-or-string like every Kubernetes quantity field (and NVIDIA's resource.Quantity).
    if isinstance(value, Quantity):
        quantity = value
    elif isinstance(value, str):
        try:
            quantity = parse_quantity(value)
        except QuantityError as error:
            raise value_error(error.reason) from None
    elif type(value) is int:
        quantity = Quantity(str(value), Fraction(value))
    else:
        raise value_error(summary="not a quantity")
    if quantity.value <= 0:
        raise value_error(summary="not positive")
    if not quantity.is_integer():
        raise value_error("not a whole number of bytes")
    if quantity.value > INT64_MAX:
        raise value_error("more than 2^63-1 bytes")
    return quantity


def _quantity_text(quantity: Quantity) -> str:
    return quantity.text


# A device index (NVIDIA's form: position among the share's devices), a published device
# name (gpu-0, gpu-0-mig-1g10gb-0) or a GPU/MIG UUID. The plugin maps them to devices.
_DEVICE_KEY = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?|(GPU|MIG)-[0-9a-fA-F-]{1,64}")


def _device_key(key: str) -> str:
    if _DEVICE_KEY.fullmatch(key) is None:
        raise value_error(summary="not a device")
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
Strategy: TypeAlias = Annotated[SharingStrategy, Strict(False), BeforeValidator(only_str)]
Interval: TypeAlias = Annotated[TimeSliceInterval, Strict(False), BeforeValidator(only_str)]


# --------------------------------------------------------------------------- models


class TimeSlicingConfig(StrictModel):
    """Time-slice length for the processes sharing a whole GPU."""

    interval: Interval = Field(
        default=TimeSliceInterval.DEFAULT, description="Default, Short, Medium or Long"
    )


class MpsConfig(StrictModel):
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
            "Per-device override of defaultPinnedDeviceMemoryLimit, keyed as NVIDIA's DRA "
            "driver keys it: the index of the device among the devices this config applies "
            "to, ordered by UUID (0 is the first), or the device's UUID; a device name "
            "(gpu-0) is accepted too. A key that matches none of them is refused"
        ),
        json_schema_extra={"propertyNames": {"pattern": f"^({_DEVICE_KEY.pattern})$"}},
    )
    multiUser: bool | None = Field(
        default=None,
        description=(
            "Not supported: true in a claim's or class's config is refused (no MPS control "
            "daemon flexgpu starts has a multi-user mode, and NVIDIA's DRA driver has no such "
            "field; see docs/migrating.md); false changes nothing"
        ),
    )


def _check_blocks(strategy: SharingStrategy, time_slicing: bool, mps: bool) -> None:
    """NVIDIA's rule: each settings block only with its own strategy."""
    if time_slicing and mps:
        raise conflict(
            "",
            "timeSlicingConfig and mpsConfig together are not allowed",
            "timeSlicingConfig with strategy TimeSlicing, or mpsConfig with strategy MPS",
        )
    if time_slicing and strategy is not SharingStrategy.TIME_SLICING:
        raise conflict(
            "timeSlicingConfig",
            f"not allowed with strategy {strategy.value}",
            "only with strategy TimeSlicing",
        )
    if mps and strategy is not SharingStrategy.MPS:
        raise conflict(
            "mpsConfig", f"not allowed with strategy {strategy.value}", "only with strategy MPS"
        )


class GpuSharing(StrictModel):
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


class MigSharing(StrictModel):
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


class GpuConfig(StrictModel):
    """Configuration of a whole GPU or a share of one (devices of gpu.flexgpu.dev and
    shared-gpu.flexgpu.dev)."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    apiVersion: Literal["gpu.flexgpu.dev/v1alpha1"] = "gpu.flexgpu.dev/v1alpha1"
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing | None = None
    share: ShareConfig | None = None  # only on a shared GPU (driver.config_support)

    @property
    def effective_sharing(self) -> GpuSharing:
        return self.sharing if self.sharing is not None else GpuSharing()

    def to_parameters(self) -> dict[str, Any]:
        return _to_parameters(self)


class MigConfig(StrictModel):
    """Configuration of a MIG device (devices of mig.flexgpu.dev)."""

    model_config = ConfigDict(json_schema_extra=_require_type_meta)

    apiVersion: Literal["gpu.flexgpu.dev/v1alpha1"] = "gpu.flexgpu.dev/v1alpha1"
    kind: Literal["MigConfig", "MigDeviceConfig"] = "MigConfig"
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
    MIG_DEVICE_CONFIG_KIND: MigConfig,
}


def _to_parameters(config: OpaqueConfig) -> dict[str, Any]:
    """JSON-ready ``parameters`` holding what was set, always with apiVersion and kind."""
    body = config.model_dump(mode="json", exclude_unset=True)
    return {"apiVersion": config.apiVersion, "kind": config.kind, **body}


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema per kind, keyed by file name (checked in under driver/schemas/)."""
    out: dict[str, dict[str, Any]] = {}
    for kind, model in CONFIG_MODELS.items():
        if model.model_fields["kind"].default != kind:
            continue  # an alias of a kind that has its own schema
        schema = model.model_json_schema()
        out[f"{kind.lower()}.json"] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            **schema,
        }
    return out


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class ConfigProblem(Problem):
    """One reason a config was rejected. ``path`` holds field names and map keys from the
    root of ``parameters``; ``detail`` is the text after the path."""

    def render(self, prefix: str | None = None) -> str:
        """``sharing.strategy: ...``; with ``prefix`` (e.g. ``spec.devices.config[0].opaque
        .parameters``) the path is appended to it. The root itself is ``parameters``."""
        joined = join_path(self.path)
        if prefix is None:
            name = joined if joined and not joined.startswith("[") else "parameters" + joined
        else:
            name = prefix + ("." if joined and not joined.startswith("[") else "") + joined
        return printable(f"{name}: {self.detail}")


class OpaqueConfigError(ProblemsError[ConfigProblem]):
    """The parameters are not a valid config. ``problems`` holds one text per problem (at most
    ``MAX_PROBLEMS``, then a count of the rest); ``details`` the same, structured."""

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
_PER_DEVICE: Final = "defaultPerDevicePinnedMemoryLimit"
# What each field of a sharing block allows, by its path inside the block ("*": any map key),
# and what its maps' keys allow. A GpuNodePolicy's spec.sharing is a GpuSharing: it uses these.
SHARING_ALLOWED: Final[dict[Pattern, str]] = {
    ("strategy",): ", ".join(SharingStrategy),
    ("timeSlicingConfig", "interval"): ", ".join(TimeSliceInterval),
    ("mpsConfig", "defaultActiveThreadPercentage"): "an integer from 1 to 100",
    ("mpsConfig", "defaultPinnedDeviceMemoryLimit"): _QUANTITY_ALLOWED,
    ("mpsConfig", _PER_DEVICE): 'an object of device to quantity, e.g. {"0": "4Gi"}',
    ("mpsConfig", _PER_DEVICE, "*"): _QUANTITY_ALLOWED,
    ("mpsConfig", "multiUser"): "true or false",
}
SHARING_KEYS_ALLOWED: Final[dict[Pattern, str]] = {
    ("mpsConfig", _PER_DEVICE): (
        'a device index ("0"), a device name ("gpu-0") or a UUID ("GPU-...", "MIG-...")'
    ),
}
_ALLOWED: Final[dict[Pattern, str]] = {
    ("apiVersion",): OPAQUE_API_VERSION,
    ("kind",): _KINDS_ALLOWED,
    **nested(("sharing",), SHARING_ALLOWED),
    ("share", "computeLimit"): COMPUTE_LIMIT_ALLOWED,
}
_KEYS_ALLOWED: Final = nested(("sharing",), SHARING_KEYS_ALLOWED)
_RULES: Final[dict[str, MessageRules]] = {
    GPU_CONFIG_KIND: MessageRules(
        model=GpuConfig,
        allowed=_ALLOWED,
        fallback="see the JSON Schema of GpuConfig",
        keys_allowed=_KEYS_ALLOWED,
    ),
    MIG_CONFIG_KIND: MessageRules(
        model=MigConfig,
        allowed=_ALLOWED,
        fallback="see the JSON Schema of MigConfig",
        keys_allowed=_KEYS_ALLOWED,
        unknown_field_hints={
            ("sharing", "timeSlicingConfig"): (
                " (a MIG device has no time-slice interval; strategy TimeSlicing needs no settings)"
            ),
        },
    ),
}


_MISSING: Final = object()


def parse_opaque_config(raw: bytes | str | Mapping[str, Any]) -> OpaqueConfig:
    """Parse ``opaque.parameters`` (raw JSON bytes or text, or decoded JSON) into a config.

    Raises ``OpaqueConfigError`` listing every problem found, and nothing else, for any input.
    """
    data, problems = _load(raw)
    if problems:
        raise OpaqueConfigError(problems)
    if not isinstance(data, dict):
        raise OpaqueConfigError([ConfigProblem((), value_detail(data, ROOT_ALLOWED))])
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
        rules = _RULES[model.model_fields["kind"].default]
        problems += [translate(rules, entry, ConfigProblem) for entry in error.errors()]
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
            return plain_copy(strict_json_loads(raw)), []
        except json.JSONDecodeError as error:
            reason = f"{error.msg} at line {error.lineno} column {error.colno}"
        except RecursionError:
            reason = "nested too deeply"
        except ValueError as error:  # from our hooks: duplicate key, NaN/Infinity
            reason = str(error)
        detail = f"invalid JSON ({reason}) is not allowed; allowed: {ROOT_ALLOWED}"
        return None, [ConfigProblem((), detail)]
    return plain_copy(raw), []


def _value_problem(
    path: tuple[object, ...], value: object, allowed: str, reason: str = ""
) -> ConfigProblem:
    return ConfigProblem(path, value_detail(value, allowed, reason))
