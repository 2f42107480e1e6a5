"""Which config applies to each allocated device: precedence, request scoping (including
firstAvailable subrequests), other drivers, kind against device type, and the webhook check."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgpu.driver.config_resolution import (
    ConfigResolutionError,
    ConfigSource,
    DeviceType,
    config_applies_to_device,
    default_config,
    parse_config_entries,
    resolve_configs,
    validate_config_entries,
    wrong_kind_message,
)
from flexgpu.driver.opaque_config import (
    GpuConfig,
    MigConfig,
    OpaqueConfig,
    SharingStrategy,
    parse_opaque_config,
)

V = "gpu.flexgpu.dev/v1alpha1"


def params(kind: str = "GpuConfig", strategy: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"apiVersion": V, "kind": kind}
    if strategy is not None:
        out["sharing"] = {"strategy": strategy}
    return out


def entry(
    parameters: Any,
    *requests: str,
    source: str = "FromClaim",
    driver: str = "gpu.flexgpu.dev",
) -> dict[str, Any]:
    out: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        out["requests"] = list(requests)
    return out


def strategy_for(
    configs: list[dict[str, Any]], request: str, device_type: DeviceType = "gpu"
) -> str:
    resolved = resolve_configs(configs, [request])[request]
    config = resolved.for_device(device_type, "dev-0")
    return config.effective_sharing.strategy.value


def test_no_configs_give_the_default_for_the_device() -> None:
    resolved = resolve_configs([], ["gpu"])["gpu"]
    assert resolved.candidates == ()
    assert resolved.winner is None
    assert resolved.for_device("gpu", "gpu-0") == GpuConfig()
    assert resolved.for_device("shared", "gpu-0") == GpuConfig()
    assert resolved.for_device("mig", "gpu-0-mig-1g10gb-0") == MigConfig()
    assert resolve_configs(None, ["gpu"])["gpu"].winner is None


def test_claim_configs_rank_above_class_configs_whatever_the_order() -> None:
    configs = [
        entry(params(strategy="MPS"), "gpu", source="FromClaim"),
        entry(params(strategy="TimeSlicing"), "gpu", source="FromClass"),
    ]
    assert strategy_for(configs, "gpu") == "MPS"
    assert strategy_for(list(reversed(configs)), "gpu") == "MPS"


def test_later_entries_win_within_a_source() -> None:
    for source in ("FromClass", "FromClaim"):
        configs = [
            entry(params(strategy="MPS"), "gpu", source=source),
            entry(params(strategy="TimeSlicing"), "gpu", source=source),
        ]
        assert strategy_for(configs, "gpu") == "TimeSlicing"


def test_candidates_are_ordered_by_precedence() -> None:
    configs = [
        entry(params(strategy="MPS"), source="FromClaim"),
        entry(params(strategy="TimeSlicing"), "gpu", source="FromClass"),
        entry(params(strategy="Exclusive"), source="FromClaim"),
        entry(params(strategy="MPS"), "other", source="FromClaim"),
    ]
    resolved = resolve_configs(configs, ["gpu"])["gpu"]
    assert [c.index for c in resolved.candidates] == [2, 0, 1]
    assert [c.source for c in resolved.candidates] == [
        ConfigSource.CLAIM,
        ConfigSource.CLAIM,
        ConfigSource.CLASS,
    ]
    assert resolved.winner == parse_opaque_config(params(strategy="Exclusive"))


def test_scoped_configs_apply_only_to_their_requests() -> None:
    configs = [entry(params(strategy="MPS"), "a", "b")]
    resolved = resolve_configs(configs, ["a", "b", "c"])
    assert (
        resolved["a"].winner == resolved["b"].winner == parse_opaque_config(params(strategy="MPS"))
    )
    assert resolved["c"].winner is None


def test_a_main_request_name_covers_its_subrequests() -> None:
    configs = [entry(params(strategy="MPS"), "main")]
    resolved = resolve_configs(configs, ["main/large", "main/small", "mainframe", "other/large"])
    assert resolved["main/large"].winner is not None
    assert resolved["main/small"].winner is not None
    assert resolved["mainframe"].winner is None
    assert resolved["other/large"].winner is None


def test_a_subrequest_name_covers_only_that_subrequest() -> None:
    configs = [entry(params(strategy="MPS"), "main/large")]
    resolved = resolve_configs(configs, ["main/large", "main/small", "main"])
    assert resolved["main/large"].winner is not None
    assert resolved["main/small"].winner is None
    assert resolved["main"].winner is None


def test_names_carry_no_specificity_only_order_counts() -> None:
    specific_first = [
        entry(params(strategy="MPS"), "main/large"),
        entry(params(strategy="TimeSlicing"), "main"),
    ]
    assert strategy_for(specific_first, "main/large") == "TimeSlicing"
    assert strategy_for(list(reversed(specific_first)), "main/large") == "MPS"


def test_other_drivers_and_unknown_config_types_are_ignored() -> None:
    configs = [
        entry(params(strategy="MPS"), "gpu"),
        entry({"anything": ["at", "all"]}, "gpu", driver="gpu.nvidia.com"),
        entry("not even an object", driver="other.example.com"),
        {"source": "FromClaim", "requests": ["gpu"], "future": {"driver": "gpu.flexgpu.dev"}},
    ]
    resolved = resolve_configs(configs, ["gpu"])["gpu"]
    assert [c.index for c in resolved.candidates] == [0]


def test_blanket_config_of_the_wrong_kind_is_skipped() -> None:
    # One claim, a GPU request and a MIG request, one blanket config of each kind. (A MIG
    # device supports only Exclusive so far: an explicit Exclusive tells it from the default.)
    explicit_mig = parse_opaque_config(params("MigConfig", "Exclusive"))
    assert explicit_mig != MigConfig()
    configs = [
        entry(params("MigConfig", "Exclusive")),
        entry(params("GpuConfig", "TimeSlicing")),
    ]
    resolved = resolve_configs(configs, ["gpu", "mig"])
    assert resolved["gpu"].for_device("gpu", "gpu-0").kind == "GpuConfig"
    assert resolved["mig"].for_device("mig", "gpu-1-mig-1g10gb-0") == explicit_mig
    # A blanket GpuConfig from the claim does not hide the MIG class's config.
    configs = [
        entry(params("MigConfig", "Exclusive"), "mig", source="FromClass"),
        entry(params("GpuConfig", "MPS")),
    ]
    assert resolve_configs(configs, ["mig"])["mig"].for_device("mig", "dev-0") == explicit_mig
    # Nothing fitting: the default of the device's kind.
    assert (
        resolve_configs([entry(params("MigConfig"))], ["gpu"])["gpu"].for_device("gpu", "gpu-0")
        == GpuConfig()
    )


def test_mps_on_a_mig_device_is_accepted_as_nvidia_accepts_it() -> None:
    # Prepare starts an MPS daemon of the claim's own for its MIG devices.
    resolved = resolve_configs([entry(params("MigConfig", "MPS"))], ["mig"])["mig"]
    config = resolved.for_device("mig", "gpu-0-mig-1g10gb-0")
    assert isinstance(config, MigConfig)
    assert config.effective_sharing.strategy is SharingStrategy.MPS


@pytest.mark.parametrize("kind", ["GpuConfig", "MigConfig"])
def test_multi_user_true_is_refused_on_every_kind(kind: str) -> None:
    parameters = params(kind, "MPS")
    parameters["sharing"]["mpsConfig"] = {"multiUser": True}
    with pytest.raises(ConfigResolutionError) as caught:
        resolve_configs([entry(parameters)], ["gpu"])
    (problem,) = caught.value.problems
    assert problem.startswith(
        "config[0].opaque.parameters.sharing.mpsConfig.multiUser: true is not supported: "
    )
    parameters["sharing"]["mpsConfig"] = {"multiUser": False}
    assert resolve_configs([entry(parameters)], ["gpu"])["gpu"].winner is not None


def test_time_slicing_on_a_mig_device_is_accepted_as_nvidia_accepts_it() -> None:
    # Nothing to set on the device (no interval exists for a MIG device), so nothing refuses.
    resolved = resolve_configs([entry(params("MigConfig", "TimeSlicing"))], ["mig"])["mig"]
    config = resolved.for_device("mig", "gpu-0-mig-1g10gb-0")
    assert isinstance(config, MigConfig)
    assert config.effective_sharing.strategy is SharingStrategy.TIME_SLICING


def test_scoped_config_of_the_wrong_kind_is_an_error() -> None:
    configs = [entry(params("GpuConfig")), entry(params("MigConfig"), "gpu")]
    resolved = resolve_configs(configs, ["gpu"])["gpu"]
    with pytest.raises(ConfigResolutionError) as caught:
        resolved.for_device("gpu", "gpu-0")
    assert caught.value.problems == [
        'request "gpu": MigConfig cannot configure a whole GPU (gpu-0); use GpuConfig '
        "(config[1] from the claim)"
    ]
    configs = [entry(params("GpuConfig"), "mig", source="FromClass")]
    with pytest.raises(ConfigResolutionError) as caught:
        resolve_configs(configs, ["mig"])["mig"].for_device("mig", "gpu-0-mig-1g10gb-0")
    assert str(caught.value) == (
        'request "mig": GpuConfig cannot configure a MIG device (gpu-0-mig-1g10gb-0); '
        "use MigConfig (config[0] from the class)"
    )


@pytest.mark.parametrize(
    ("kind", "device_type", "applies"),
    [
        ("GpuConfig", "gpu", True),
        ("GpuConfig", "shared", True),
        ("GpuConfig", "mig", False),
        ("MigConfig", "mig", True),
        ("MigConfig", "gpu", False),
        ("MigConfig", "shared", False),
    ],
)
def test_config_applies_to_device(kind: str, device_type: DeviceType, applies: bool) -> None:
    config = parse_opaque_config(params(kind))
    assert config_applies_to_device(config, device_type) is applies


def test_wrong_kind_message_texts() -> None:
    cases: list[tuple[OpaqueConfig, DeviceType, str, str]] = [
        (
            MigConfig(),
            "gpu",
            "gpu-0",
            'request "r": MigConfig cannot configure a whole GPU (gpu-0); use GpuConfig',
        ),
        (
            MigConfig(),
            "shared",
            "gpu-1",
            'request "r": MigConfig cannot configure a shared GPU (gpu-1); use GpuConfig',
        ),
        (
            GpuConfig(),
            "mig",
            "gpu-0-mig-3g40gb-4",
            'request "r": GpuConfig cannot configure a MIG device (gpu-0-mig-3g40gb-4); '
            "use MigConfig",
        ),
    ]
    for config, device_type, name, text in cases:
        assert not config_applies_to_device(config, device_type)
        assert wrong_kind_message(config, "r", device_type, name) == text


def test_unknown_device_type_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown device type 'vgpu'; known: gpu, mig, shared"):
        default_config("vgpu")  # type: ignore[arg-type]


def test_every_entry_for_the_driver_is_parsed_and_every_problem_reported() -> None:
    configs = [
        entry(params(strategy="Shared"), "unused"),
        {"requests": ["gpu"], "opaque": {"driver": "gpu.flexgpu.dev", "parameters": params()}},
        entry(params(), source="Elsewhere"),
        {
            "source": "FromClaim",
            "requests": "gpu",
            "opaque": {"driver": "gpu.flexgpu.dev", "parameters": params()},
        },
        {"source": "FromClaim", "opaque": {"driver": "gpu.flexgpu.dev"}},
        {"source": "FromClaim", "opaque": {"driver": 5}},
        "nonsense",
        entry(b"\xff"),
        entry({"kind": "GpuConfig"}),
    ]
    with pytest.raises(ConfigResolutionError) as caught:
        resolve_configs(configs, ["gpu"])
    root = (
        'a JSON object with apiVersion "gpu.flexgpu.dev/v1alpha1" and kind GpuConfig or MigConfig'
    )
    assert caught.value.problems == [
        'config[0].opaque.parameters.sharing.strategy: "Shared" is not allowed; allowed: '
        "Exclusive, TimeSlicing, MPS",
        "config[1].source: missing; allowed: FromClass, FromClaim",
        'config[2].source: "Elsewhere" is not allowed; allowed: FromClass, FromClaim',
        'config[3].requests: "gpu" is not allowed; allowed: a list of request names ("gpu", '
        'or "main/sub" for a subrequest)',
        f"config[4].opaque.parameters: missing; allowed: {root}",
        'config[5].opaque: {"driver": 5} is not allowed; allowed: an object with driver and '
        "parameters",
        'config[6]: "nonsense" is not allowed; allowed: an object with source, requests and opaque',
        "config[7].opaque.parameters: invalid UTF-8 (byte 0xff at offset 0) is not allowed; "
        f"allowed: {root}",
        f"config[8].opaque.parameters.apiVersion: missing; allowed: {V}",
    ]


def test_config_list_must_be_a_list() -> None:
    with pytest.raises(ConfigResolutionError) as caught:
        resolve_configs({"opaque": {}}, ["gpu"])
    assert caught.value.problems == [
        'config: {"opaque": {}} is not allowed; allowed: a list of device configurations'
    ]


def test_spec_configs_take_their_source_from_the_caller() -> None:
    class_entries = parse_config_entries(
        [{"opaque": {"driver": "gpu.flexgpu.dev", "parameters": params(strategy="MPS")}}],
        path="spec.config",
        source=ConfigSource.CLASS,
    )
    assert [(e.source, e.requests) for e in class_entries] == [(ConfigSource.CLASS, ())]
    [sharing] = [e.config.effective_sharing for e in class_entries]
    assert sharing.strategy is SharingStrategy.MPS


# --------------------------------------------------------------------------- webhook


def test_webhook_reports_problems_under_the_objects_path() -> None:
    configs = [
        {
            "requests": ["gpu"],
            "opaque": {"driver": "gpu.flexgpu.dev", "parameters": params(strategy="MPS")},
        },
        {
            "opaque": {
                "driver": "gpu.flexgpu.dev",
                "parameters": {**params(), "sharing": {"mpsConfig": {}}},
            }
        },
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"kind": "Whatever"}}},
    ]
    assert validate_config_entries(configs[:1], path="spec.devices.config") == []
    assert validate_config_entries(configs, path="spec.spec.devices.config") == [
        "spec.spec.devices.config[1].opaque.parameters.sharing.mpsConfig: not allowed with "
        "strategy Exclusive; allowed: only with strategy MPS"
    ]


def test_webhook_checks_kinds_against_the_requests_classes() -> None:
    configs = [
        {
            "requests": ["gpu"],
            "opaque": {"driver": "gpu.flexgpu.dev", "parameters": params("MigConfig")},
        },
        {
            "requests": ["main"],
            "opaque": {"driver": "gpu.flexgpu.dev", "parameters": params("GpuConfig")},
        },
        {
            "requests": ["main/big"],
            "opaque": {"driver": "gpu.flexgpu.dev", "parameters": params("GpuConfig")},
        },
        {"opaque": {"driver": "gpu.flexgpu.dev", "parameters": params("GpuConfig")}},
    ]
    types: dict[str, DeviceType] = {"gpu": "gpu", "main/big": "gpu", "main/small": "mig"}
    problems = validate_config_entries(
        configs, path="spec.devices.config", request_device_types=types
    )
    assert problems == [
        'spec.devices.config[0]: request "gpu": MigConfig cannot configure a whole GPU; '
        "use GpuConfig",
        'spec.devices.config[1]: request "main/small": GpuConfig cannot configure a MIG device; '
        "use MigConfig",
    ]


def test_nvidia_claim_template_migrates_by_changing_driver_and_api_version() -> None:
    yaml = pytest.importorskip("yaml")
    # NVIDIA's gpu-test-mps demo, with only `driver` and `apiVersion` changed.
    template = yaml.safe_load(
        """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: mps-gpu
spec:
  spec:
    devices:
      requests:
      - name: mps-gpu
        exactly:
          deviceClassName: gpu.flexgpu.dev
      config:
      - requests: ["mps-gpu"]
        opaque:
          driver: gpu.flexgpu.dev
          parameters:
            apiVersion: gpu.flexgpu.dev/v1alpha1
            kind: GpuConfig
            sharing:
              strategy: MPS
              mpsConfig:
                defaultActiveThreadPercentage: 50
                defaultPinnedDeviceMemoryLimit: 10Gi
"""
    )
    configs = template["spec"]["spec"]["devices"]["config"]
    assert validate_config_entries(configs, path="spec.spec.devices.config") == []
    # As the allocator copies it into the claim's status.
    allocated = [{"source": "FromClaim", **c} for c in configs]
    config = resolve_configs(allocated, ["mps-gpu"])["mps-gpu"].for_device("gpu", "gpu-0")
    assert isinstance(config, GpuConfig)
    mps = config.effective_sharing.mpsConfig
    assert mps is not None and mps.defaultActiveThreadPercentage == 50
    assert mps.defaultPinnedDeviceMemoryLimit is not None
    assert mps.defaultPinnedDeviceMemoryLimit.to_int() == 10 * 2**30


# --------------------------------------------------------------------------- properties

ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
ENTRY = st.fixed_dictionaries(
    {
        "source": st.sampled_from(["FromClass", "FromClaim"]) | ANY,
        "requests": st.lists(st.sampled_from(["a", "b", "main", "main/x"]), max_size=3) | ANY,
        "opaque": st.fixed_dictionaries(
            {
                "driver": st.sampled_from(["gpu.flexgpu.dev", "other"]) | ANY,
                "parameters": st.sampled_from([params(), params("MigConfig", "MPS")]) | ANY,
            }
        )
        | ANY,
    }
)


@settings(max_examples=200, deadline=None)
@given(st.lists(ENTRY | ANY, max_size=5) | ANY)
def test_resolution_gives_a_result_or_a_resolution_error(configs: object) -> None:
    try:
        resolved = resolve_configs(configs, ["a", "main/x"])
    except ConfigResolutionError as error:
        assert error.problems
        return
    for request, result in resolved.items():
        for device_type in ("gpu", "mig", "shared"):
            try:
                config = result.for_device(device_type, "dev")  # type: ignore[arg-type]
            except ConfigResolutionError as error:
                assert f'request "{request}"' in str(error)
            else:
                assert config_applies_to_device(config, device_type)  # type: ignore[arg-type]
