"""The simulated hardware behind fake_pynvml.FakeNvml: GPUs, their MIG profiles and event
sets, with the figures NVML reports on the products modelled (A100-SXM4-80GB with driver 580,
T4), and the small helpers the stand-in's parts share."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

NO_INSTANCE = 0xFFFFFFFF
MIB = 1024 * 1024


@dataclass
class FakeProfile:
    enum: int
    id: int
    name: str
    slices: int
    instances: int
    sms: int
    ce: int
    dec: int
    jpeg: int
    ofa: int
    memory_mb: int
    starts: tuple[int, ...]
    size: int


# `nvidia-smi mig -lgip` / `-lgipp` of an A100-SXM4-80GB.
A100_80GB_PROFILES = [
    FakeProfile(0, 19, "MIG 1g.10gb", 1, 7, 14, 1, 0, 0, 0, 9728, (0, 1, 2, 3, 4, 5, 6), 1),
    FakeProfile(7, 20, "MIG 1g.10gb+me", 1, 1, 14, 1, 1, 1, 1, 9728, (0, 1, 2, 3, 4, 5, 6), 1),
    FakeProfile(9, 15, "MIG 1g.20gb", 1, 4, 14, 1, 1, 0, 0, 19968, (0, 2, 4, 6), 2),
    FakeProfile(1, 14, "MIG 2g.20gb", 2, 3, 28, 2, 1, 0, 0, 19968, (0, 2, 4), 2),
    FakeProfile(2, 9, "MIG 3g.40gb", 3, 2, 42, 3, 2, 0, 0, 40192, (0, 4), 4),
    FakeProfile(3, 5, "MIG 4g.40gb", 4, 1, 56, 4, 2, 0, 0, 40192, (0,), 4),
    FakeProfile(4, 0, "MIG 7g.80gb", 7, 1, 98, 7, 5, 1, 1, 80896, (0,), 8),
]
# NVML compute instance profile enum -> id for the full-size compute instance.
CI_PROFILE_IDS = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus_id: str  # as NVML prints it, 8-digit domain
    memory_mib: int
    arch: int
    cc: tuple[int, int]
    brand: int = pynvml.NVML_BRAND_NVIDIA
    profiles: list[FakeProfile] | None = None  # None: no MIG support
    mig_enabled: bool = False
    mig_pending: bool = False
    nvlink: list[str] | None = None  # per link: remote bus id, or "switch"; None: no NVLink
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    lost: bool = False
    processes: list[SimpleNamespace] = field(default_factory=list)
    # gpu instance id -> (profile, start, size, compute instance ids)
    instances: dict[int, tuple[FakeProfile, int, int, list[int]]] = field(default_factory=dict)


def a100_80gb(uuid: str, bus_id: str, mig_enabled: bool = True) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB",
        uuid=uuid,
        bus_id=bus_id,
        memory_mib=81920,
        arch=pynvml.NVML_DEVICE_ARCH_AMPERE,
        cc=(8, 0),
        profiles=A100_80GB_PROFILES,
        mig_enabled=mig_enabled,
        mig_pending=mig_enabled,
        nvlink=["none"] * 12,
    )


def t4(uuid: str, bus_id: str) -> FakeGpu:
    return FakeGpu(
        name="Tesla T4",
        uuid=uuid,
        bus_id=bus_id,
        memory_mib=15360,
        arch=pynvml.NVML_DEVICE_ARCH_TURING,
        cc=(7, 5),
    )


@dataclass
class FakeEventSet:
    """One event set: the GPUs registered in it and how far it has read the raised events."""

    read: int
    registered: set[int] = field(default_factory=set)
    freed: bool = False


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _gpu_instance_id(start: int, size: int) -> int:
    return {8: 0, 4: 1, 2: 3, 1: 7}[size] + start // size


def _deref(ref: Any) -> Any:
    return ref._obj if hasattr(ref, "_obj") else ref.contents
