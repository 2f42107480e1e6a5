"""GpuConfig / MigConfig: exact rejection texts, round trips, NVIDIA-shaped manifests, and a
property test that no input makes the parser raise anything but OpaqueConfigError."""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexgpu.driver.gpu_model import TimeSliceInterval
from flexgpu.driver.names import OPAQUE_API_VERSION
from flexgpu.driver.opaque_config import (
    MAX_PROBLEMS,
    GpuConfig,
    GpuSharing,
    MigConfig,
    MigSharing,
    MpsConfig,
    OpaqueConfigError,
    SharingStrategy,
    TimeSlicingConfig,
    parse_opaque_config,
)
from flexgpu.driver.quantity import Quantity

V = "gpu.flexgpu.dev/v1alpha1"
ROOT = 'a JSON object with apiVersion "gpu.flexgpu.dev/v1alpha1" and kind GpuConfig or MigConfig'
QTY = 'a Kubernetes quantity of whole bytes greater than 0, e.g. "10Gi"'
MPS_FIELDS = (
    "defaultActiveThreadPercentage, defaultPinnedDeviceMemoryLimit, "
    "defaultPerDevicePinnedMemoryLimit, multiUser"
)
PCT = "sharing.mpsConfig.defaultActiveThreadPercentage"
PIN = "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"
PER = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"


def gpu(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": V, "kind": "GpuConfig", "sharing": sharing}


def mig(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": V, "kind": "MigConfig", "sharing": sharing}


def mps(**settings_: Any) -> dict[str, Any]:
    return gpu(strategy="MPS", mpsConfig=settings_)


BAD: list[tuple[str, object, list[str]]] = [
    # --- identity
    (
        "wrong kind (NVIDIA's GPU kind is GpuConfig too; its VFIO kind is not ours)",
        {"apiVersion": V, "kind": "VfioDeviceConfig"},
        ['kind: "VfioDeviceConfig" is not allowed; allowed: GpuConfig, MigConfig, MigDeviceConfig'],
    ),
    (
        "kind not a string",
        {"apiVersion": V, "kind": 7},
        ["kind: 7 is not allowed; allowed: GpuConfig, MigConfig, MigDeviceConfig"],
    ),
    (
        "wrong apiVersion (NVIDIA's)",
        {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"},
        ['apiVersion: "resource.nvidia.com/v1beta1" is not allowed; allowed: ' + V],
    ),
    (
        "wrong apiVersion and kind",
        {"apiVersion": "v1", "kind": "Pod"},
        [
            'apiVersion: "v1" is not allowed; allowed: ' + V,
            'kind: "Pod" is not allowed; allowed: GpuConfig, MigConfig, MigDeviceConfig',
        ],
    ),
    (
        "empty object",
        {},
        [
            "apiVersion: missing; allowed: " + V,
            "kind: missing; allowed: GpuConfig, MigConfig, MigDeviceConfig",
        ],
    ),
    (
        "apiVersion missing, body still checked",
        {"kind": "GpuConfig", "sharing": {"strategy": "Shared"}},
        [
            "apiVersion: missing; allowed: " + V,
            'sharing.strategy: "Shared" is not allowed; allowed: Exclusive, TimeSlicing, MPS',
        ],
    ),
    # --- unknown fields
    (
        "unknown top-level field",
        {"apiVersion": V, "kind": "GpuConfig", "spec": {}},
        ["spec: unknown field; allowed: apiVersion, kind, sharing, share"],
    ),
    (
        "unknown nested field",
        mps(defaultActiveThreadPercent=50),
        [f"sharing.mpsConfig.defaultActiveThreadPercent: unknown field; allowed: {MPS_FIELDS}"],
    ),
    (
        "snake_case spelling is not an alias",
        gpu(strategy="MPS", mps_config={}),
        ["sharing.mps_config: unknown field; allowed: strategy, timeSlicingConfig, mpsConfig"],
    ),
    (
        "unknown field with an odd name",
        gpu(**{"a.b": 1}),
        ['sharing["a.b"]: unknown field; allowed: strategy, timeSlicingConfig, mpsConfig'],
    ),
    (
        "timeSlicingConfig on a MIG device",
        mig(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}),
        [
            "sharing.timeSlicingConfig: unknown field (a MIG device has no time-slice "
            "interval; strategy TimeSlicing needs no settings); allowed: strategy, mpsConfig"
        ],
    ),
    # --- enums
    (
        "unknown strategy",
        gpu(strategy="Shared"),
        ['sharing.strategy: "Shared" is not allowed; allowed: Exclusive, TimeSlicing, MPS'],
    ),
    (
        "strategy is case-sensitive",
        gpu(strategy="mps"),
        ['sharing.strategy: "mps" is not allowed; allowed: Exclusive, TimeSlicing, MPS'],
    ),
    (
        "strategy null",
        gpu(strategy=None),
        ["sharing.strategy: null is not allowed; allowed: Exclusive, TimeSlicing, MPS"],
    ),
    (
        "unknown interval",
        gpu(strategy="TimeSlicing", timeSlicingConfig={"interval": "VeryLong"}),
        [
            'sharing.timeSlicingConfig.interval: "VeryLong" is not allowed; '
            "allowed: Default, Short, Medium, Long"
        ],
    ),
    # --- percentage
    (
        "percentage 0",
        mps(defaultActiveThreadPercentage=0),
        [f"{PCT}: 0 is not allowed; allowed: an integer from 1 to 100"],
    ),
    (
        "percentage 101",
        mps(defaultActiveThreadPercentage=101),
        [f"{PCT}: 101 is not allowed; allowed: an integer from 1 to 100"],
    ),
    (
        "percentage as a string",
        mps(defaultActiveThreadPercentage="50"),
        [f'{PCT}: "50" is not allowed; allowed: an integer from 1 to 100'],
    ),
    (
        "percentage as a float",
        mps(defaultActiveThreadPercentage=50.0),
        [f"{PCT}: 50.0 is not allowed; allowed: an integer from 1 to 100"],
    ),
    (
        "percentage as a bool",
        mps(defaultActiveThreadPercentage=True),
        [f"{PCT}: true is not allowed; allowed: an integer from 1 to 100"],
    ),
    (
        "huge integer",
        mps(defaultActiveThreadPercentage=10**100),
        [f"{PCT}: a 101-digit integer is not allowed; allowed: an integer from 1 to 100"],
    ),
    # --- quantities
    (
        "negative quantity",
        mps(defaultPinnedDeviceMemoryLimit="-1Gi"),
        [f'{PIN}: "-1Gi" is not allowed; allowed: {QTY}'],
    ),
    (
        "zero quantity",
        mps(defaultPinnedDeviceMemoryLimit="0"),
        [f'{PIN}: "0" is not allowed; allowed: {QTY}'],
    ),
    (
        "zero as a number",
        mps(defaultPinnedDeviceMemoryLimit=0),
        [f"{PIN}: 0 is not allowed; allowed: {QTY}"],
    ),
    (
        "malformed quantity",
        mps(defaultPinnedDeviceMemoryLimit="10GB"),
        [f'{PIN}: "10GB" is not allowed (unknown suffix "GB"); allowed: {QTY}'],
    ),
    (
        "not a number at all",
        mps(defaultPinnedDeviceMemoryLimit="lots"),
        [f'{PIN}: "lots" is not allowed (does not start with a number); allowed: {QTY}'],
    ),
    (
        "fractional bytes",
        mps(defaultPinnedDeviceMemoryLimit="100m"),
        [f'{PIN}: "100m" is not allowed (not a whole number of bytes); allowed: {QTY}'],
    ),
    (
        "beyond int64",
        mps(defaultPinnedDeviceMemoryLimit="8Ei"),
        [f'{PIN}: "8Ei" is not allowed (more than 2^63-1 bytes); allowed: {QTY}'],
    ),
    (
        "quantity as a float",
        mps(defaultPinnedDeviceMemoryLimit=1.5),
        [f"{PIN}: 1.5 is not allowed; allowed: {QTY}"],
    ),
    (
        "per-device: bad key and bad value",
        mps(defaultPerDevicePinnedMemoryLimit={"GPU 0": "1Gi", "1": "-1"}),
        [
            f'{PER}: key "GPU 0" is not allowed; allowed: a device index ("0"), '
            'a device name ("gpu-0") or a UUID ("GPU-...", "MIG-...")',
            f'{PER}["1"]: "-1" is not allowed; allowed: {QTY}',
        ],
    ),
    (
        # A map key is shown in brackets even when it looks like a field name.
        "per-device: bad value under a key that looks like a field",
        mps(defaultPerDevicePinnedMemoryLimit={"gpu0": "-1"}),
        [f'{PER}["gpu0"]: "-1" is not allowed; allowed: {QTY}'],
    ),
    (
        "per-device: not an object",
        mps(defaultPerDevicePinnedMemoryLimit=["1Gi"]),
        [
            f'{PER}: ["1Gi"] is not allowed; allowed: an object of device to quantity, '
            'e.g. {"0": "4Gi"}'
        ],
    ),
    # --- blocks against strategy
    (
        "both sharing blocks",
        gpu(strategy="MPS", timeSlicingConfig={}, mpsConfig={}),
        [
            "sharing: timeSlicingConfig and mpsConfig together are not allowed; allowed: "
            "timeSlicingConfig with strategy TimeSlicing, or mpsConfig with strategy MPS"
        ],
    ),
    (
        "timeSlicingConfig with strategy MPS",
        gpu(strategy="MPS", timeSlicingConfig={"interval": "Short"}),
        [
            "sharing.timeSlicingConfig: not allowed with strategy MPS; "
            "allowed: only with strategy TimeSlicing"
        ],
    ),
    (
        "mpsConfig with strategy TimeSlicing",
        gpu(strategy="TimeSlicing", mpsConfig={}),
        [
            "sharing.mpsConfig: not allowed with strategy TimeSlicing; "
            "allowed: only with strategy MPS"
        ],
    ),
    (
        "mpsConfig without a strategy (Exclusive)",
        gpu(mpsConfig={"defaultActiveThreadPercentage": 50}),
        ["sharing.mpsConfig: not allowed with strategy Exclusive; allowed: only with strategy MPS"],
    ),
    (
        "mpsConfig on MIG with strategy TimeSlicing",
        mig(strategy="TimeSlicing", mpsConfig={}),
        [
            "sharing.mpsConfig: not allowed with strategy TimeSlicing; "
            "allowed: only with strategy MPS"
        ],
    ),
    # --- shapes
    (
        "sharing as a string",
        {"apiVersion": V, "kind": "GpuConfig", "sharing": "MPS"},
        [
            'sharing: "MPS" is not allowed; allowed: an object with fields strategy, '
            "timeSlicingConfig, mpsConfig"
        ],
    ),
    (
        "mpsConfig as a list",
        gpu(strategy="MPS", mpsConfig=[]),
        [f"sharing.mpsConfig: [] is not allowed; allowed: an object with fields {MPS_FIELDS}"],
    ),
    (
        "several problems, in field order",
        gpu(
            strategy="MPS",
            mpsConfig={"defaultActiveThreadPercentage": 0, "defaultPinnedDeviceMemoryLimit": "x"},
            extra=1,
        ),
        [
            f"{PCT}: 0 is not allowed; allowed: an integer from 1 to 100",
            f'{PIN}: "x" is not allowed (does not start with a number); allowed: {QTY}',
            "sharing.extra: unknown field; allowed: strategy, timeSlicingConfig, mpsConfig",
        ],
    ),
    # --- not an object
    ("JSON array", "[1, 2]", [f"parameters: [1, 2] is not allowed; allowed: {ROOT}"]),
    ("JSON number", b"42", [f"parameters: 42 is not allowed; allowed: {ROOT}"]),
    ("JSON null", "null", [f"parameters: null is not allowed; allowed: {ROOT}"]),
    ("JSON string", '"GpuConfig"', [f'parameters: "GpuConfig" is not allowed; allowed: {ROOT}']),
    ("Python list", [V], [f'parameters: ["{V}"] is not allowed; allowed: {ROOT}']),
    (
        "a huge JSON number",
        "9" * 5000,
        [f"parameters: a 5000-digit integer is not allowed; allowed: {ROOT}"],
    ),
    # --- not JSON
    (
        "truncated JSON",
        '{"apiVersion": ',
        [
            "parameters: invalid JSON (Expecting value at line 1 column 16) is not allowed; "
            f"allowed: {ROOT}"
        ],
    ),
    (
        "empty text",
        "",
        [
            "parameters: invalid JSON (Expecting value at line 1 column 1) is not allowed; "
            f"allowed: {ROOT}"
        ],
    ),
    (
        "YAML is not JSON",
        "kind: GpuConfig",
        [
            "parameters: invalid JSON (Expecting value at line 1 column 1) is not allowed; "
            f"allowed: {ROOT}"
        ],
    ),
    (
        "invalid UTF-8",
        b'{"kind": "\xff"}',
        [f"parameters: invalid UTF-8 (byte 0xff at offset 10) is not allowed; allowed: {ROOT}"],
    ),
    (
        "duplicate key",
        '{"apiVersion": "x", "apiVersion": "y"}',
        [f'parameters: invalid JSON (duplicate key "apiVersion") is not allowed; allowed: {ROOT}'],
    ),
    (
        "NaN",
        '{"kind": NaN}',
        [f"parameters: invalid JSON (NaN is not JSON) is not allowed; allowed: {ROOT}"],
    ),
    (
        "nested too deeply",
        "[" * 100_000 + "]" * 100_000,
        [f"parameters: invalid JSON (nested too deeply) is not allowed; allowed: {ROOT}"],
    ),
]


@pytest.mark.parametrize(("raw", "problems"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_rejects_with_exact_text(raw: Any, problems: list[str]) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config(raw)
    assert caught.value.problems == problems
    assert str(caught.value) == "; ".join(problems)


def test_error_is_a_value_error_with_structured_details() -> None:
    with pytest.raises(ValueError) as caught:
        parse_opaque_config(gpu(strategy="Shared"))
    error = caught.value
    assert isinstance(error, OpaqueConfigError)
    [detail] = error.details
    assert detail.path == ("sharing", "strategy")
    assert error.render("spec.devices.config[0].opaque.parameters") == [
        'spec.devices.config[0].opaque.parameters.sharing.strategy: "Shared" is not allowed; '
        "allowed: Exclusive, TimeSlicing, MPS"
    ]


def test_many_problems_are_capped() -> None:
    raw = {"apiVersion": V, "kind": "GpuConfig", **{f"f{i:02}": i for i in range(30)}}
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config(raw)
    problems = caught.value.problems
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[0] == "f00: unknown field; allowed: apiVersion, kind, sharing, share"
    assert problems[-1] == f"... and {30 - MAX_PROBLEMS} more problems"


def test_long_values_are_shortened() -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config(gpu(strategy="x" * 1000))
    [problem] = caught.value.problems
    shown = problem.removeprefix("sharing.strategy: ").split(" is not allowed")[0]
    assert len(shown) == 60 and shown.endswith("...")


def test_lone_surrogates_are_escaped() -> None:
    # JSON may spell a lone surrogate; it can be neither validated nor sent back as UTF-8.
    head = '{"apiVersion": "' + V + '", "kind": "GpuConfig", '
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config(head + '"\\ud800": 1}')
    assert caught.value.problems == [
        r'parameters["\\ud800"]: unknown field; allowed: apiVersion, kind, sharing, share'
    ]
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config(head + '"sharing": {"strategy": "\\udc00"}}')
    assert caught.value.problems == [
        r'sharing.strategy: "\\udc00" is not allowed; allowed: Exclusive, TimeSlicing, MPS'
    ]


# --------------------------------------------------------------------------- good configs

GOOD: list[dict[str, Any]] = [
    {"apiVersion": V, "kind": "GpuConfig"},
    {"apiVersion": V, "kind": "MigConfig"},
    {"apiVersion": V, "kind": "MigDeviceConfig"},
    gpu(),
    gpu(strategy="Exclusive"),
    gpu(strategy="TimeSlicing"),
    gpu(strategy="TimeSlicing", timeSlicingConfig={}),
    gpu(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}),
    gpu(strategy="MPS"),
    mps(defaultActiveThreadPercentage=1),
    mps(defaultActiveThreadPercentage=100, defaultPinnedDeviceMemoryLimit="10Gi"),
    mps(
        defaultPinnedDeviceMemoryLimit="1.5G",
        defaultPerDevicePinnedMemoryLimit={
            "0": "4Gi",
            "gpu-1": "512Mi",
            "gpu-0-mig-1g10gb-0": "1e9",
            "GPU-4b2d6a8e-1f0c-4a5e-9d7b-2c3e4f5a6b7c": "1",
        },
    ),
    mig(strategy="TimeSlicing"),
    mig(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 25}),
]


@pytest.mark.parametrize("raw", GOOD, ids=lambda raw: json.dumps(raw)[40:100])
def test_good_configs_round_trip(raw: dict[str, Any]) -> None:
    config = parse_opaque_config(raw)
    assert config.to_parameters() == raw
    assert parse_opaque_config(json.dumps(raw)) == config
    assert parse_opaque_config(json.dumps(raw).encode()) == config
    assert parse_opaque_config(config.to_parameters()) == config


def test_parsed_values_are_typed() -> None:
    config = parse_opaque_config(
        mps(
            defaultActiveThreadPercentage=50,
            defaultPinnedDeviceMemoryLimit="10Gi",
            defaultPerDevicePinnedMemoryLimit={"0": 4 * 2**30},
        )
    )
    assert isinstance(config, GpuConfig)
    sharing = config.effective_sharing
    assert sharing.strategy is SharingStrategy.MPS
    assert sharing.mpsConfig is not None
    assert sharing.mpsConfig.defaultActiveThreadPercentage == 50
    assert sharing.mpsConfig.defaultPinnedDeviceMemoryLimit == Quantity(
        "10Gi", Fraction(10 * 2**30)
    )
    per_device = sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit
    assert per_device is not None and per_device["0"].to_int() == 4 * 2**30
    # A JSON number for a quantity (as Kubernetes accepts) is written back as a string.
    assert config.to_parameters()["sharing"]["mpsConfig"]["defaultPerDevicePinnedMemoryLimit"] == {
        "0": str(4 * 2**30)
    }

    interval = parse_opaque_config(gpu(strategy="TimeSlicing", timeSlicingConfig={}))
    assert isinstance(interval, GpuConfig) and interval.sharing is not None
    assert interval.sharing.timeSlicingConfig == TimeSlicingConfig(
        interval=TimeSliceInterval.DEFAULT
    )


def test_defaults_are_exclusive() -> None:
    assert GpuConfig().effective_sharing == GpuSharing(strategy=SharingStrategy.EXCLUSIVE)
    assert MigConfig().effective_sharing == MigSharing(strategy=SharingStrategy.EXCLUSIVE)
    assert GpuConfig().to_parameters() == {"apiVersion": V, "kind": "GpuConfig"}
    assert (
        parse_opaque_config({"apiVersion": V, "kind": "GpuConfig", "sharing": None}) == GpuConfig()
    )


def test_api_version_matches_names() -> None:
    assert V == OPAQUE_API_VERSION
    assert GpuConfig().apiVersion == MigConfig().apiVersion == OPAQUE_API_VERSION


def test_python_construction_enforces_the_same_rules() -> None:
    with pytest.raises(ValueError, match="timeSlicingConfig and mpsConfig together"):
        GpuSharing(
            strategy=SharingStrategy.MPS,
            timeSlicingConfig=TimeSlicingConfig(),
            mpsConfig=MpsConfig(),
        )
    sharing = GpuSharing(strategy=SharingStrategy.MPS, mpsConfig=MpsConfig())
    assert GpuConfig(sharing=sharing).to_parameters() == gpu(strategy="MPS", mpsConfig={})


# NVIDIA's k8s-dra-driver-gpu demo claims (gpu-test-mps, gpu-test4), verbatim but for
# `driver` and `apiVersion`.
NVIDIA_MPS = """
sharing:
  strategy: MPS
  mpsConfig:
    defaultActiveThreadPercentage: 50
    defaultPinnedDeviceMemoryLimit: 10Gi
    defaultPerDevicePinnedMemoryLimit:
      "0": 5Gi
"""
NVIDIA_TIME_SLICING = """
sharing:
  strategy: TimeSlicing
  timeSlicingConfig:
    interval: Long
"""


@pytest.mark.parametrize("body", [NVIDIA_MPS, NVIDIA_TIME_SLICING])
def test_nvidia_manifest_migrates_by_changing_only_api_version(body: str) -> None:
    yaml = pytest.importorskip("yaml")
    nvidia = yaml.safe_load("apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\n" + body)
    with pytest.raises(OpaqueConfigError, match=r"^apiVersion: \"resource.nvidia.com/v1beta1\""):
        parse_opaque_config(nvidia)
    migrated = {**nvidia, "apiVersion": V}
    config = parse_opaque_config(migrated)
    assert config.to_parameters() == migrated


# --------------------------------------------------------------------------- properties

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**60, max_value=10**80)
    # Beyond Python's 4300-digit int/str conversion limit (built lazily: hypothesis would
    # fail to print such a literal in the strategy's repr).
    | st.sampled_from([1, -1]).map(lambda sign: sign * 10**5000)
    | st.floats()
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5)
    ),
    max_leaves=30,
)
ABSENT = object()


def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly (4 in 5) a plausible value, sometimes anything. (one_of(good, good, ...) would
    not do: it picks among the flattened alternatives, most of them JSON's.)"""
    return st.integers(0, 4).flatmap(lambda pick: good if pick else JSON)


def obj(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """An object whose fields are each present about two times in three."""
    maybe = {
        name: st.integers(0, 2).flatmap(lambda pick, v=value: v if pick else st.just(ABSENT))
        for name, value in fields.items()
    }
    return st.fixed_dictionaries(maybe).map(
        lambda d: {k: v for k, v in d.items() if v is not ABSENT}
    )


QUANTITIES = st.sampled_from(["10Gi", "1", "0", "-1Gi", "1.5", "100m", "8Ei", "1e3", "x"])
MPS_CONFIG = obj(
    defaultActiveThreadPercentage=field(st.integers(min_value=-1, max_value=102)),
    defaultPinnedDeviceMemoryLimit=field(QUANTITIES | st.integers(-1, 2**64)),
    defaultPerDevicePinnedMemoryLimit=field(
        st.dictionaries(st.sampled_from(["0", "gpu-0", "GPU-ab12", "x y", ""]), field(QUANTITIES))
    ),
    extra=JSON,
)
SHARING = obj(
    strategy=field(st.sampled_from(["Exclusive", "TimeSlicing", "MPS", "Shared"])),
    timeSlicingConfig=field(obj(interval=field(st.sampled_from(["Default", "Long", "Never"])))),
    mpsConfig=field(MPS_CONFIG),
)
# Near-valid configs reach the deep validation paths that random JSON rarely does.
NEAR_VALID = obj(
    apiVersion=field(st.just(V)),
    kind=field(st.sampled_from(["GpuConfig", "MigConfig", "MigDeviceConfig"])),
    sharing=field(SHARING),
)


def check_outcome(raw: object) -> None:
    try:
        config = parse_opaque_config(raw)  # type: ignore[arg-type]
    except OpaqueConfigError as error:
        assert error.problems
        for detail in error.details:
            text = detail.render()
            assert ": " in text and "allowed" in text, text
            text.encode("utf-8")
    else:
        assert isinstance(config, GpuConfig | MigConfig)
        assert parse_opaque_config(config.to_parameters()) == config


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON)
def test_any_json_value_gives_a_config_or_an_opaque_config_error(value: object) -> None:
    check_outcome(value)
    try:
        text = json.dumps(value)
    except ValueError:
        return
    check_outcome(text)
    check_outcome(text.encode())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(NEAR_VALID)
def test_near_valid_configs_give_a_config_or_an_opaque_config_error(value: object) -> None:
    check_outcome(value)
    try:
        text = json.dumps(value)
    except ValueError:
        return
    check_outcome(text)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64))
def test_any_bytes_or_text_gives_a_config_or_an_opaque_config_error(raw: bytes | str) -> None:
    check_outcome(raw)


@pytest.mark.parametrize(
    "raw",
    [
        None,
        42,
        {1: 2, (1, 2): 3, None: 4},
        {"apiVersion": V, "kind": "GpuConfig", "sharing": {"mpsConfig": {"x": object()}}},
        {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": b"MPS"}},
        mps(defaultPerDevicePinnedMemoryLimit={10**300: "1Gi", None: 5}),
        mps(defaultPinnedDeviceMemoryLimit=float("nan")),
        bytearray(b"{}"),
        memoryview(b"[]"),
    ],
    ids=repr,
)
def test_odd_python_inputs_give_an_opaque_config_error(raw: object) -> None:
    with pytest.raises(OpaqueConfigError):
        parse_opaque_config(raw)  # type: ignore[arg-type]


def test_deeply_nested_python_data_gives_an_opaque_config_error() -> None:
    deep: Any = "leaf"
    for _ in range(50_000):
        deep = {"a": deep}
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config({"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": deep}})
    shown = '{"a": ' * 9 + '{"a...'  # cut at 60 characters
    assert caught.value.problems == [
        f"sharing.strategy: {shown} is not allowed; allowed: Exclusive, TimeSlicing, MPS"
    ]


def test_nvidia_mig_kind_reads_as_mig_config_and_keeps_its_name() -> None:
    """A manifest written for NVIDIA's driver says MigDeviceConfig: it configures MIG devices
    exactly as MigConfig does, and round-trips under the kind it was written with."""
    raw = {"apiVersion": V, "kind": "MigDeviceConfig", "sharing": {"strategy": "Exclusive"}}
    config = parse_opaque_config(raw)
    assert isinstance(config, MigConfig)
    assert config.to_parameters() == raw
    assert parse_opaque_config(config.to_parameters()) == config


def test_multi_user_is_a_boolean_of_mps_config() -> None:
    """NVIDIA's mpsConfig.multiUser is accepted; anything but a JSON boolean is refused."""
    config = parse_opaque_config(gpu(strategy="MPS", mpsConfig={"multiUser": True}))
    assert isinstance(config, GpuConfig)
    mps = config.effective_sharing.mpsConfig
    assert mps is not None and mps.multiUser is True
    with pytest.raises(OpaqueConfigError) as caught:
        parse_opaque_config(gpu(strategy="MPS", mpsConfig={"multiUser": "yes"}))
    assert caught.value.problems == [
        'sharing.mpsConfig.multiUser: "yes" is not allowed; allowed: true or false'
    ]
