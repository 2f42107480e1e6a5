"""Dynamic-MIG publication: the counters the scheduler checks admit exactly the partition sets
a GPU can hold, and the device order puts small partitions at the top of the GPU."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from flexgpu.driver.gpu_model import GpuInfo, MigEngines, MigMode, MigPlacement, MigProfile
from flexgpu.driver.mig_catalog import COMPUTE_SLICES, MIG_PRODUCT_FAMILIES, mig_profiles_for
from flexgpu.driver.mig_devices import (
    COMPUTE_COUNTER,
    MigPartition,
    compute_counter_binds,
    counter_set,
    dynamic_mig_devices,
    placement_order,
    profile_counter,
)


def _gpu() -> GpuInfo:
    return GpuInfo.model_validate(
        {
            "index": 0,
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "product_name": "NVIDIA H100 80GB HBM3",
            "brand": "Nvidia",
            "architecture": "Hopper",
            "cuda_compute_capability": "9.0",
            "driver_version": "580.95.05",
            "cuda_driver_version": "13.0",
            "memory_mib": 81559,
            "multiprocessors": 132,
            "pci_bus_id": "0000:18:00.0",
            "nvlink_domain": "nvl-abc",
            "mig_capable": True,
            "mig_mode": MigMode(current=True, pending=True),
        }
    )


def _fits(free: dict[str, int], device: dict[str, Any]) -> dict[str, int] | None:
    left = dict(free)
    for consumption in device["consumesCounters"]:
        for name, amount in consumption["counters"].items():
            left[name] = left[name] - int(amount["value"])
            if left[name] < 0:
                return None
    return left


def _counter_admitted(
    devices: Sequence[dict[str, Any]], free: dict[str, int]
) -> Iterator[frozenset[str]]:
    """Every non-empty set of partitions the scheduler's counter check lets through."""

    def walk(i: int, left: dict[str, int], chosen: list[str]) -> Iterator[frozenset[str]]:
        if i == len(devices):
            if chosen:
                yield frozenset(chosen)
            return
        after = _fits(left, devices[i])
        if after is not None:
            yield from walk(i + 1, after, [*chosen, devices[i]["name"]])
        yield from walk(i + 1, left, chosen)

    return walk(0, free, [])


def _valid(parts: Sequence[MigPartition], profiles: Sequence[MigProfile]) -> bool:
    """What NVML allows: memory-disjoint placements, at most the compute slices, and at most
    each profile's instance limit."""
    by_id = {p.profile_id: p for p in profiles}
    for i, a in enumerate(parts):
        if any(a.placement.overlaps(b.placement) for b in parts[i + 1 :]):
            return False
    if sum(by_id[p.profile_id].compute_slices for p in parts) > COMPUTE_SLICES:
        return False
    counts: dict[int, int] = {}
    for p in parts:
        counts[p.profile_id] = counts.get(p.profile_id, 0) + 1
    return all(n <= by_id[pid].max_instances for pid, n in counts.items())


def _all_valid(
    names: dict[str, MigPartition], profiles: Sequence[MigProfile]
) -> set[frozenset[str]]:
    items = sorted(names.items())
    found: set[frozenset[str]] = set()

    def walk(i: int, chosen: list[tuple[str, MigPartition]]) -> None:
        if i == len(items):
            if chosen:
                found.add(frozenset(n for n, _ in chosen))
            return
        if _valid([p for _, p in chosen] + [items[i][1]], profiles):
            walk(i + 1, [*chosen, items[i]])
        walk(i + 1, chosen)

    walk(0, [])
    return found


@pytest.mark.parametrize("family", MIG_PRODUCT_FAMILIES)
def test_counters_admit_exactly_the_partition_sets_the_gpu_can_hold(family: str) -> None:
    profiles = list(mig_profiles_for(family))
    devices, partitions = dynamic_mig_devices(_gpu(), profiles)
    free = {n: int(c["value"]) for n, c in counter_set(_gpu(), profiles)["counters"].items()}
    mig = [d for d in devices if d["name"] != "gpu-0"]
    admitted = set(_counter_admitted(mig, free))
    assert "gpu-0" not in partitions  # the whole GPU is the GPU itself, not a partition
    assert admitted == _all_valid(partitions, profiles)
    # The whole GPU is allocatable alone and with nothing else.
    whole = next(d for d in devices if d["name"] == "gpu-0")
    after = _fits(free, whole)
    assert after is not None
    assert all(_fits(after, d) is None for d in mig)


def test_only_binding_counters_are_published_on_8_slice_gpus() -> None:
    profiles = list(mig_profiles_for("H100-80GB"))
    counters = counter_set(_gpu(), profiles)["counters"]
    me = next(p for p in profiles if p.name.endswith("+me"))
    assert sorted(counters) == sorted(
        [f"memory-slice-{i}" for i in range(8)] + [profile_counter(me.profile_id)]
    )


def test_compute_counter_is_published_where_memory_alone_would_overcommit_compute() -> None:
    engines = MigEngines(copy_engines=1, decoders=0, encoders=0, jpeg_decoders=0, ofa=0)
    one = MigProfile(
        name="1g.10gb",
        profile_id=19,
        compute_slices=1,
        memory_slices=1,
        memory_mib=10000,
        multiprocessors=16,
        engines=engines,
        max_instances=8,
        placements=tuple(MigPlacement(start=s, size=1) for s in range(8)),  # 8 > 7 compute
    )
    assert compute_counter_binds([one])
    assert COMPUTE_COUNTER in counter_set(_gpu(), [one])["counters"]
    devices, _ = dynamic_mig_devices(_gpu(), [one])
    assert all(COMPUTE_COUNTER in d["consumesCounters"][0]["counters"] for d in devices)
    assert not compute_counter_binds(list(mig_profiles_for("H100-80GB")))


def test_small_partitions_fill_from_the_top_and_large_ones_from_slice_0() -> None:
    by_name = {p.name: p for p in mig_profiles_for("H100-80GB")}
    assert [p.start for p in placement_order(by_name["1g.10gb"])] == [6, 5, 4, 3, 2, 1, 0]
    assert [p.start for p in placement_order(by_name["2g.20gb"])] == [4, 2, 0]
    assert [p.start for p in placement_order(by_name["1g.20gb"])] == [6, 4, 2, 0]
    assert [p.start for p in placement_order(by_name["3g.40gb"])] == [0, 4]
    devices, _ = dynamic_mig_devices(_gpu(), list(by_name.values()))
    names = [d["name"] for d in devices]
    assert names[0] == "gpu-0"  # the whole GPU first
    assert names.index("gpu-0-mig-1g10gb-6") < names.index("gpu-0-mig-1g10gb-0")
    assert names.index("gpu-0-mig-3g40gb-0") < names.index("gpu-0-mig-3g40gb-4")
