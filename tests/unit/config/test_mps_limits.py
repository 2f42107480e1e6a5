"""defaultPerDevicePinnedMemoryLimit keyed as NVIDIA keys it: an index into the config's devices
ordered by UUID, or a UUID (a device name too); a key that matches no device is refused, at
admission when the request's count shows it, at prepare always."""

from __future__ import annotations

from typing import Any

import pytest

from flexgpu.driver.config_resolution import request_device_counts, validate_config_entries
from flexgpu.driver.mps_limits import (
    ConfiguredDevice,
    PinnedLimitError,
    index_keys_beyond,
    pinned_memory_limits,
)
from flexgpu.driver.opaque_config import MpsConfig, parse_opaque_config
from flexgpu.driver.quantity import parse_quantity

V = "gpu.flexgpu.dev/v1alpha1"
PER = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"
# Published in index order, but gpu-7's UUID sorts first: NVIDIA's index 0 is gpu-7.
GPU2 = ConfiguredDevice("gpu-2", "GPU-b0000000-0000-0000-0000-000000000000")
GPU7 = ConfiguredDevice("gpu-7", "GPU-a0000000-0000-0000-0000-000000000000")


def mps(**fields: Any) -> MpsConfig:
    config = parse_opaque_config(
        {"apiVersion": V, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": fields}}
    )
    block = config.effective_sharing.mpsConfig
    assert block is not None
    return block


def gib(text: str) -> object:
    return parse_quantity(text).value


def test_index_counts_the_configs_devices_by_uuid_order_not_the_nodes_gpu_index() -> None:
    limits = pinned_memory_limits(
        mps(defaultPinnedDeviceMemoryLimit="10Gi", defaultPerDevicePinnedMemoryLimit={"0": "12Gi"}),
        [GPU2, GPU7],
    )
    assert {name: q.value if q else None for name, q in limits.items()} == {
        "gpu-7": gib("12Gi"),
        "gpu-2": gib("10Gi"),
    }


def test_uuid_and_name_keys_pick_their_device_and_unset_default_means_no_limit() -> None:
    limits = pinned_memory_limits(
        mps(defaultPerDevicePinnedMemoryLimit={GPU2.uuid: "3Gi", "gpu-7": "5Gi"}),
        [GPU2, GPU7],
    )
    assert limits["gpu-2"] is not None and limits["gpu-2"].value == gib("3Gi")
    assert limits["gpu-7"] is not None and limits["gpu-7"].value == gib("5Gi")
    assert pinned_memory_limits(mps(), [GPU2]) == {"gpu-2": None}


def test_a_key_that_matches_no_device_is_refused_with_the_devices_listed() -> None:
    with pytest.raises(PinnedLimitError) as caught:
        pinned_memory_limits(
            mps(defaultPerDevicePinnedMemoryLimit={"2": "12Gi", "gpu-9": "1Gi", "0": "1Gi"}),
            [GPU2, GPU7],
        )
    texts = [p.render() for p in caught.value.problems]
    listed = f"0 = gpu-7 ({GPU7.uuid}), 1 = gpu-2 ({GPU2.uuid})"
    assert texts == [
        f'{PER}: key "{key}" matches no device of the claim; allowed: an index from 0 to 1, or '
        f"the name or UUID of a device the config applies to (by UUID order: {listed})"
        for key in ("2", "gpu-9")
    ]


def test_index_keys_beyond_the_count_are_the_only_ones_admission_can_refuse() -> None:
    config = mps(defaultPerDevicePinnedMemoryLimit={"0": "1Gi", "1": "1Gi", "gpu-5": "1Gi"})
    assert index_keys_beyond(config, 2) == []
    (problem,) = index_keys_beyond(config, 1)
    assert problem.render() == (
        f'{PER}: key "1" matches no device of the claim; allowed: an index below 1 (the config '
        "applies to 1 device, indexed by UUID order from 0)"
    )


def claim_config(per_device: dict[str, str], requests: list[str] | None = None) -> dict[str, Any]:
    parameters = {
        "apiVersion": V,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": per_device},
        },
    }
    entry: dict[str, Any] = {"opaque": {"driver": "gpu.flexgpu.dev", "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def request(name: str, count: int | None = None, mode: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.flexgpu.dev"}
    if count is not None:
        exactly["count"] = count
    if mode is not None:
        exactly["allocationMode"] = mode
    return {"name": name, "exactly": exactly}


@pytest.mark.parametrize(
    ("requests", "per_device", "refused"),
    [
        ([request("gpu")], {"0": "4Gi"}, False),
        # The reported case: 12Gi meant for the claim's second GPU, but the claim has one.
        ([request("gpu")], {"1": "12Gi"}, True),
        ([request("gpu", count=2)], {"1": "12Gi"}, False),
        ([request("a"), request("b")], {"1": "12Gi"}, False),  # one config, two devices
        ([request("gpu", mode="All")], {"5": "12Gi"}, False),  # count unknown until allocation
        ([request("gpu")], {"gpu-3": "12Gi"}, False),  # names are checked at prepare
    ],
)
def test_admission_refuses_index_keys_beyond_the_requested_devices(
    requests: list[dict[str, Any]], per_device: dict[str, str], refused: bool
) -> None:
    problems = validate_config_entries(
        [claim_config(per_device)],
        path="spec.devices.config",
        request_device_types={r["name"]: "gpu" for r in requests},
        request_counts=request_device_counts(requests),
    )
    assert bool(problems) is refused
    if refused:
        assert problems == [
            f'spec.devices.config[0].opaque.parameters.{PER}: key "1" matches no device of the '
            "claim; allowed: an index below 1 (the config applies to 1 device, indexed by UUID "
            "order from 0)"
        ]


def test_subrequest_alternatives_count_once_at_their_largest() -> None:
    requests = [
        {
            "name": "main",
            "firstAvailable": [
                {"name": "two", "deviceClassName": "gpu.flexgpu.dev", "count": 2},
                {"name": "one", "deviceClassName": "gpu.flexgpu.dev"},
            ],
        }
    ]
    counts = request_device_counts(requests)
    assert counts == {"main/two": 2, "main/one": 1}
    types: dict[str, Any] = {"main/two": "gpu", "main/one": "gpu"}
    ok = validate_config_entries(
        [claim_config({"1": "1Gi"})], path="c", request_device_types=types, request_counts=counts
    )
    beyond = validate_config_entries(
        [claim_config({"2": "1Gi"})], path="c", request_device_types=types, request_counts=counts
    )
    assert ok == [] and len(beyond) == 1


def test_the_webhook_refuses_the_claim_with_the_field_named() -> None:
    from flexgpu.controller.admission import validate_resource_claim

    claim = {
        "spec": {"devices": {"requests": [request("gpu")], "config": [claim_config({"1": "12Gi"})]}}
    }
    (problem,) = validate_resource_claim(claim)
    assert problem.startswith(f'spec.devices.config[0].opaque.parameters.{PER}: key "1" matches')
