"""The reduction the NVIDIA differential tests rest on (tests/integration/nvidia_differential.py):
devices of the two drivers meet by GPU, profile and placement whatever their names; a
difference every GPU shares is one row; a fact only one side publishes is one row per field;
quantities compare by value; a withdrawn device and a tainted one read differently."""

from __future__ import annotations

from typing import Any

from tests.integration.nvidia_differential import ABSENT, differences, reduce


def _slice(devices: list[dict[str, Any]], counters: list[Any] | None = None) -> dict[str, Any]:
    return {"spec": {"devices": devices, "sharedCounters": counters or []}}


def _nvidia_gpu(i: int, memory: str = "80Gi", **extra: Any) -> dict[str, Any]:
    return {
        "name": f"gpu-{i}",
        "attributes": {
            "uuid": {"string": f"GPU-{i}"},
            "brand": {"string": "Nvidia"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:1{i}:00.0"},
        },
        "capacity": {"memory": {"value": memory}},
        **extra,
    }


def _flexgpu_gpu(i: int, memory: str = "85899345920") -> dict[str, Any]:
    return {
        "name": f"gpu-{i}",
        "attributes": {
            "uuid": {"string": f"GPU-{i}"},
            "index": {"int": i},
            "brand": {"string": "NVIDIA"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:1{i}:00.0"},
        },
        "capacity": {"memory": {"value": memory}},
    }


def _nvidia_mig(i: int, start: int) -> dict[str, Any]:
    return {
        "name": f"gpu-{i}-mig-1g10gb-19-{start}",
        "attributes": {
            "type": {"string": "mig"},
            "profile": {"string": "1g.10gb"},
            "parentUUID": {"string": f"GPU-{i}"},
            "uuid": {"string": f"MIG-{i}-{start}"},
        },
    }


def _flexgpu_mig(i: int, start: int) -> dict[str, Any]:
    return {
        "name": f"gpu-{i}-mig-1g.10gb-{start}",
        "attributes": {
            "type": {"string": "mig"},
            "profile": {"string": "1g.10gb"},
            "parentIndex": {"int": i},
            "placementStart": {"int": start},
            "parentUUID": {"string": f"GPU-{i}"},
            "uuid": {"string": f"MIG-{i}-{start}"},
        },
    }


def test_devices_meet_by_gpu_profile_and_placement_not_by_name() -> None:
    nvidia = reduce("nvidia", [_slice([_nvidia_mig(2, 0), _nvidia_mig(2, 3)])])
    flexgpu = reduce("flexgpu", [_slice([_flexgpu_mig(2, 3), _flexgpu_mig(2, 0)])])
    assert set(nvidia.devices) == set(flexgpu.devices) == {(2, "1g.10gb", 0), (2, "1g.10gb", 3)}
    rows = differences("c", nvidia, flexgpu)
    assert ("c", "device", "published", ABSENT) not in rows
    # Names differ in shape only; the uuid, parent and profile match once templated.
    shapes = ("gpu-<i>-mig-<profile>-<id>-<start>", "gpu-<i>-mig-<profile>-<start>")
    assert rows[("c", "name", *shapes)] == "MIG 1g.10gb"
    assert not [row for row in rows if row[1] in {"attribute uuid", "attribute parentUUID"}]


def test_a_difference_every_gpu_shares_is_one_row_and_quantities_compare_by_value() -> None:
    nvidia = reduce("nvidia", [_slice([_nvidia_gpu(i) for i in range(4)])])
    flexgpu = reduce("flexgpu", [_slice([_flexgpu_gpu(i) for i in range(4)])])
    rows = differences("c", nvidia, flexgpu)
    assert rows == {
        ("c", "attribute brand", "string Nvidia", "string NVIDIA"): "GPU",
        # Each GPU's own index, published by one side only: one row, by type.
        ("c", "attribute index", ABSENT, "int"): "GPU",
    }


def test_a_changed_value_is_its_own_row() -> None:
    nvidia = reduce("nvidia", [_slice([_nvidia_gpu(0, memory="40Gi")])])
    flexgpu = reduce("flexgpu", [_slice([_flexgpu_gpu(0)])])
    rows = differences("c", nvidia, flexgpu)
    assert rows[("c", "capacity memory", "42949672960", "85899345920")] == "GPU"


def test_withdrawn_and_tainted_devices_read_differently() -> None:
    taint = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    nvidia = reduce("nvidia", [_slice([_nvidia_gpu(1, taints=[taint])])])
    flexgpu = reduce("flexgpu", [_slice([])])
    rows = differences("c", nvidia, flexgpu, gpus={1})
    assert rows == {("c", "device", "published; taint xid NoSchedule (79)", ABSENT): "GPU"}
    assert differences("c", nvidia, flexgpu, gpus={0}) == {}
