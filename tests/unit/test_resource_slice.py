"""Inventory -> ResourceSlice rendering follows the design's device model and API limits."""

from __future__ import annotations

import pytest

from flexgpu.driver.gpu_model import GpuInfo, HealthState, MigMode
from flexgpu.driver.resource_slice import (
    chunk_devices,
    render_node_gpus,
    semver,
    slice_specs,
    whole_gpu_device,
)


def _gpu(index: int, **overrides: object) -> GpuInfo:
    fields: dict[str, object] = {
        "index": index,
        "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000",
        "product_name": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cuda_compute_capability": "9.0",
        "driver_version": "580.95.05",
        "cuda_driver_version": "13.0",
        "memory_mib": 81559,
        "multiprocessors": 132,
        "pci_bus_id": f"0000:{0x18 + index:02x}:00.0",
        "pcie_root": "pci0000:15",
        "numa_node": 0,
        "nvlink_domain": "nvl-abc",
        "mig_capable": True,
        "mig_mode": MigMode(current=False, pending=False),
    }
    fields.update(overrides)
    return GpuInfo.model_validate(fields)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("9.0", "9.0.0"),
        ("580.95.05", "580.95.5"),
        ("13.0", "13.0.0"),
        ("12", "12.0.0"),
        ("535.104.12.1", "535.104.12"),
    ],
)
def test_versions_become_semver_that_cel_accepts(raw: str, expected: str) -> None:
    assert semver(raw) == expected


def test_semver_rejects_text_without_numbers() -> None:
    with pytest.raises(ValueError, match="no numeric components"):
        semver("unknown")


def test_whole_gpu_device_carries_design_attributes() -> None:
    device = whole_gpu_device(_gpu(3))
    assert device["name"] == "gpu-3"
    attrs = device["attributes"]
    assert attrs["type"] == {"string": "gpu"}
    assert attrs["index"] == {"int": 3}
    assert attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attrs["driverVersion"] == {"version": "580.95.5"}
    assert attrs["migCapable"] == {"bool": True}
    assert attrs["nvlinkDomain"] == {"string": "nvl-abc"}
    assert attrs["numaNode"] == {"int": 0}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": "0000:1b:00.0"}
    assert attrs["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:15"}
    assert device["capacity"] == {
        "memory": {"value": "81559Mi"},
        "multiprocessors": {"value": "132"},
    }


def test_unknown_numa_and_root_are_omitted_not_invented() -> None:
    attrs = whole_gpu_device(_gpu(0, numa_node=None, pcie_root=None))["attributes"]
    assert "numaNode" not in attrs
    assert "resource.kubernetes.io/pcieRoot" not in attrs


def test_unhealthy_gpus_are_not_published_and_order_is_by_index() -> None:
    gpus = [_gpu(2), _gpu(0), _gpu(1, health=HealthState.UNHEALTHY)]
    assert [d["name"] for d in render_node_gpus(gpus)] == ["gpu-0", "gpu-2"]


def test_chunking_respects_the_per_slice_device_limits() -> None:
    plain = [{"name": f"d{i}"} for i in range(300)]
    assert [len(c) for c in chunk_devices(plain)] == [128, 128, 44]
    counted = [{"name": f"d{i}", "consumesCounters": []} for i in range(130)]
    assert [len(c) for c in chunk_devices(counted)] == [64, 64, 2]
    assert chunk_devices([]) == [[]]


def test_slice_specs_agree_on_pool_generation_and_count() -> None:
    devices = [{"name": f"d{i}"} for i in range(200)]
    specs = slice_specs(
        "node-a", devices, generation=7, shared_counters=[{"name": "gpu-0", "counters": {}}]
    )
    assert len(specs) == 3
    assert {s["pool"]["generation"] for s in specs} == {7}
    assert {s["pool"]["resourceSliceCount"] for s in specs} == {3}
    assert "sharedCounters" in specs[0] and "devices" not in specs[0]
    assert sum(len(s.get("devices", [])) for s in specs) == 200


def test_too_many_attributes_is_refused_with_the_limit() -> None:
    device = {"name": "x", "attributes": {f"a{i}": {"int": i} for i in range(33)}}
    with pytest.raises(ValueError, match="at most 32"):
        slice_specs("n", [device], generation=1)


def test_quantities_compare_by_value_as_the_server_canonicalises_them() -> None:
    from flexgpu.kubelet_plugin.devices.slice_publisher import contains

    desired = {"capacity": {"memory": {"value": "40960Mi"}}, "name": "gpu-0"}
    assert contains({"capacity": {"memory": {"value": "40Gi"}}, "name": "gpu-0"}, desired)
    assert not contains({"capacity": {"memory": {"value": "41Gi"}}, "name": "gpu-0"}, desired)
    # Only quantity fields compare by value; a name never does.
    assert not contains({"name": "1k"}, {"name": "1000"})


def test_a_field_the_plugin_no_longer_sets_must_be_gone_from_the_server() -> None:
    """A restarted plugin compares the slices it finds with what it wants: binding conditions
    it no longer publishes (feature off, the GPU's tenant published), a taint cleared or an
    attribute dropped still on the server mean a write, while fields the server adds do not."""
    from flexgpu.kubelet_plugin.devices.slice_publisher import contains

    want = {"devices": [{"name": "gpu-2", "attributes": {"tenant": {"string": ""}}}]}
    held = {"devices": [{"name": "gpu-2", "attributes": {"tenant": {"string": ""}}}]}
    assert contains(held, want)
    stale = {"bindingConditions": ["gpu.flexgpu.dev/TenantReady"]}
    assert not contains({"devices": [{**held["devices"][0], **stale}]}, want)
    tainted = {"taints": [{"key": "gpu.flexgpu.dev/xid", "effect": "NoSchedule"}]}
    assert not contains({"devices": [{**held["devices"][0], **tainted}]}, want)
    extra = {"name": "gpu-2", "attributes": {"tenant": {"string": ""}, "old": {"int": 1}}}
    assert not contains({"devices": [extra]}, want)
    # Defaults inside what we set (a taint's timeAdded) are the server's to add.
    want_taint = {"devices": [{"name": "gpu-2", "taints": [{"key": "k", "effect": "None"}]}]}
    got_taint = {
        "devices": [{"name": "gpu-2", "taints": [{"key": "k", "effect": "None", "timeAdded": "t"}]}]
    }
    assert contains(got_taint, want_taint)


def test_a_1_34_server_gets_each_counter_set_beside_its_consumers() -> None:
    from flexgpu.driver.mig_devices import counter_set, dynamic_mig_devices
    from flexgpu.driver.sim_backend import SimulatedBackend

    backend = SimulatedBackend.from_topology("hgx-h100-8", "n")
    gpus = backend.list_gpus()
    devices, counters = [whole_gpu_device(gpus[7])], []
    for gpu in gpus[:2]:
        profiles = backend.mig_profiles(gpu.index) if gpu.mig_mode and gpu.mig_mode.current else []
        if not profiles:
            backend.set_mig_mode(gpu.index, True)
            profiles = backend.mig_profiles(gpu.index)
        mig, _ = dynamic_mig_devices(gpu, profiles)
        devices += mig
        counters.append(counter_set(gpu, profiles))

    own = slice_specs("n", devices, 3, counters)
    assert [("sharedCounters" in s, len(s.get("devices", []))) for s in own] == [
        (True, 0),
        (False, 53),
    ]
    legacy = slice_specs("n", devices, 3, counters, counters_in_own_slice=False)
    assert [
        (len(s["sharedCounters"]) if "sharedCounters" in s else 0, len(s["devices"]))
        for s in legacy
    ] == [(1, 26), (1, 26), (0, 1)]
    for spec in legacy[:2]:
        (counter,) = spec["sharedCounters"]
        assert {c["counterSet"] for d in spec["devices"] for c in d["consumesCounters"]} == {
            counter["name"]
        }
    assert {s["pool"]["resourceSliceCount"] for s in legacy} == {3}


def test_partitions_are_published_profile_by_profile_after_every_whole_gpu() -> None:
    from flexgpu.driver.mig_catalog import mig_profiles_for
    from flexgpu.driver.mig_devices import dynamic_mig_devices

    profiles = list(mig_profiles_for("H100-80GB"))
    devices = [whole_gpu_device(_gpu(2))]
    for index in (0, 1):
        devices += dynamic_mig_devices(_gpu(index), profiles)[0]
    specs = slice_specs("n", devices, 1, [{"name": "gpu-0", "counters": {}}])
    names = [d["name"] for spec in specs for d in spec.get("devices", [])]
    assert sorted(names) == sorted(d["name"] for d in devices)
    assert names[:3] == ["gpu-2", "gpu-0", "gpu-1"]  # plain, then dynamic-MIG whole GPUs
    ones = [n for n in names if "-mig-1g10gb-" in n and "-me-" not in n]
    # All 1g partitions before any other profile, GPU 0's first, each in placement order.
    assert names[3 : 3 + len(ones)] == ones
    assert ones == [f"gpu-{g}-mig-1g10gb-{s}" for g in (0, 1) for s in range(6, -1, -1)]
    assert names[-2:] == ["gpu-0-mig-7g80gb-0", "gpu-1-mig-7g80gb-0"]


def test_dynamic_mig_whole_gpus_can_follow_some_or_every_profile() -> None:
    from flexgpu.driver.mig_catalog import mig_profiles_for
    from flexgpu.driver.mig_devices import dynamic_mig_devices
    from flexgpu.driver.resource_slice import WHOLE_GPUS_LAST, allocation_order

    profiles = list(mig_profiles_for("H100-80GB"))
    devices = [whole_gpu_device(_gpu(2))]
    for index in (0, 1):
        devices += dynamic_mig_devices(_gpu(index), profiles)[0]
    first = [d["name"] for d in allocation_order(devices)]
    ones = [f"gpu-{g}-mig-1g10gb-{s}" for g in (0, 1) for s in range(6, -1, -1)]

    after_1g = [d["name"] for d in allocation_order(devices, whole_after_profiles=1)]
    assert after_1g[: 1 + len(ones) + 2] == ["gpu-2", *ones, "gpu-0", "gpu-1"]
    last = [d["name"] for d in allocation_order(devices, whole_after_profiles=WHOLE_GPUS_LAST)]
    assert last[:1] == ["gpu-2"] and last[-2:] == ["gpu-0", "gpu-1"]
    assert last[-4:-2] == ["gpu-0-mig-7g80gb-0", "gpu-1-mig-7g80gb-0"]
    # Only the two whole GPUs move: the partitions keep their order relative to each other.
    for moved in (after_1g, last):
        assert sorted(moved) == sorted(first)
        assert [n for n in moved if "-mig-" in n] == [n for n in first if "-mig-" in n]
    # A number past the profile count is the same as last; a negative one is refused.
    past = allocation_order(devices, whole_after_profiles=len(profiles))
    assert [d["name"] for d in past] == last
    with pytest.raises(ValueError, match="whole_after_profiles"):
        allocation_order(devices, whole_after_profiles=-1)
    specs = slice_specs("n", devices, 1, [], whole_after_profiles=1)
    assert [d["name"] for s in specs for d in s["devices"]] == after_1g
