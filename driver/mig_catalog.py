"""MIG profile tables for the simulated catalog, from NVIDIA's published MIG profile tables.

Geometry (8 memory slices, 7 compute slices, profile ids, placements, instance limits) is the
same on A100, H100, H200 and B200. Memory, multiprocessor and engine counts differ per product.
Sources: NVIDIA MIG User Guide "Supported MIG profiles" tables (names, engines, instance limits,
placements), `nvidia-smi mig -lgip` / `-lgipp` output as printed on real A100-80GB and H100-80GB
systems (memory, SMs, placements) and NVIDIA's NVML mocks (A100-40GB; H200 memory; B200 memory,
SMs and engines, which NVIDIA publishes nowhere else). docs/inventory.md lists every figure where
NVIDIA's mocks and this catalog differ, and why; tests/unit/driver/test_catalog_differential.py
keeps that list exact. On real hardware the NVML backend reads all of this from the GPU and never
uses these tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexgpu.driver.gpu_model import MigEngines, MigPlacement, MigProfile

MEMORY_SLICES = 8
COMPUTE_SLICES = 7


@dataclass(frozen=True)
class _Geometry:
    """Profile shape shared by every MIG-capable product in the catalog."""

    kind: str
    profile_id: int
    compute_slices: int
    starts: tuple[int, ...]
    size: int
    max_instances: int


# NVML profile ids: 1_SLICE=19, 1_SLICE_REV1 (+me)=20, 1_SLICE_REV2 (double memory)=15,
# 2_SLICE=14, 3_SLICE=9, 4_SLICE=5, 7_SLICE=0.
_GEOMETRY: tuple[_Geometry, ...] = (
    _Geometry("1g", 19, 1, (0, 1, 2, 3, 4, 5, 6), 1, 7),
    _Geometry("1g+me", 20, 1, (0, 1, 2, 3, 4, 5, 6), 1, 1),
    _Geometry("1g-2x", 15, 1, (0, 2, 4, 6), 2, 4),
    _Geometry("2g", 14, 2, (0, 2, 4), 2, 3),
    _Geometry("3g", 9, 3, (0, 4), 4, 2),
    _Geometry("4g", 5, 4, (0,), 4, 1),
    _Geometry("7g", 0, 7, (0,), 8, 1),
)


@dataclass(frozen=True)
class _ProductFigures:
    """Per-product figures, in the order of ``_GEOMETRY``."""

    names: tuple[str, ...]
    memory_mib: tuple[int, ...]
    multiprocessors: tuple[int, ...]
    engines: tuple[MigEngines, ...]


def _eng(ce: int, dec: int, jpeg: int = 0, ofa: int = 0, enc: int = 0) -> MigEngines:
    # No A100/H100/H200 MIG profile has an NVENC.
    return MigEngines(copy_engines=ce, decoders=dec, encoders=enc, jpeg_decoders=jpeg, ofa=ofa)


# A100: 5 NVDEC, 1 NVJPG, 1 OFA in total; only +me and 7g get the JPEG decoder and OFA.
_A100_ENGINES = (
    _eng(1, 0),
    _eng(1, 1, 1, 1),
    _eng(1, 1),
    _eng(2, 1),
    _eng(3, 2),
    _eng(4, 2),
    _eng(7, 5, 1, 1),
)
# H100/H200: 7 NVDEC, 7 NVJPG, 1 OFA; the full-GPU profile reports 8 copy engines.
_HOPPER_ENGINES = (
    _eng(1, 1, 1),
    _eng(1, 1, 1, 1),
    _eng(1, 1, 1),
    _eng(2, 2, 2),
    _eng(3, 3, 3),
    _eng(4, 4, 4),
    _eng(8, 7, 7, 1),
)
# B200: as NVIDIA's NVML mock reports them; no published table gives B200 engines per profile.
_B200_ENGINES = (
    _eng(1, 1),
    _eng(1, 1, 1, 1, enc=1),
    _eng(1, 1),
    _eng(2, 2, 1, 1, enc=1),
    _eng(3, 3, 2, 2, enc=2),
    _eng(4, 4, 2, 2, enc=2),
    _eng(7, 7, 4, 4, enc=4),
)
_A100_SMS = (14, 14, 14, 28, 42, 56, 98)
_HOPPER_SMS = (16, 16, 26, 32, 60, 64, 132)

_PRODUCTS: dict[str, _ProductFigures] = {
    "A100-40GB": _ProductFigures(
        names=("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
        memory_mib=(4864, 4864, 9856, 9856, 19968, 19968, 40192),
        multiprocessors=_A100_SMS,
        engines=_A100_ENGINES,
    ),
    "A100-80GB": _ProductFigures(
        names=("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        # nvidia-smi on A100-SXM4-80GB: 9728 / 19968 / 40192 MiB devices, 7g listed as 79.00 GiB.
        memory_mib=(9728, 9728, 19968, 19968, 40192, 40192, 80896),
        multiprocessors=_A100_SMS,
        engines=_A100_ENGINES,
    ),
    "H100-80GB": _ProductFigures(
        names=("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        # nvidia-smi on H100 80GB HBM3: 9.75 / 19.62 / 39.50 / 79.25 GiB.
        memory_mib=(9984, 9984, 20096, 20096, 40448, 40448, 81152),
        multiprocessors=_HOPPER_SMS,
        engines=_HOPPER_ENGINES,
    ),
    "H200-141GB": _ProductFigures(
        names=("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
        # From NVIDIA's NVML mocks; not yet confirmed against a real H200 listing.
        memory_mib=(18432, 18432, 35840, 35840, 72704, 72704, 144384),
        multiprocessors=_HOPPER_SMS,
        engines=_HOPPER_ENGINES,
    ),
    "B200-180GB": _ProductFigures(
        names=("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
        # From NVIDIA's NVML mocks (names and ids from the MIG User Guide); not yet confirmed
        # against a real B200 listing.
        memory_mib=(23552, 23552, 46080, 46080, 92160, 92160, 184320),
        multiprocessors=(18, 18, 18, 36, 54, 72, 126),
        engines=_B200_ENGINES,
    ),
}

MIG_PRODUCT_FAMILIES: tuple[str, ...] = tuple(_PRODUCTS)


def mig_profiles_for(family: str) -> tuple[MigProfile, ...]:
    """All MIG profiles of a product family (a key of ``MIG_PRODUCT_FAMILIES``)."""
    try:
        figures = _PRODUCTS[family]
    except KeyError:
        allowed = ", ".join(MIG_PRODUCT_FAMILIES)
        raise KeyError(f"unknown MIG product family {family!r}; allowed: {allowed}") from None
    return tuple(
        MigProfile(
            name=figures.names[i],
            profile_id=geometry.profile_id,
            compute_slices=geometry.compute_slices,
            memory_slices=geometry.size,
            memory_mib=figures.memory_mib[i],
            multiprocessors=figures.multiprocessors[i],
            engines=figures.engines[i],
            max_instances=geometry.max_instances,
            placements=tuple(MigPlacement(start=s, size=geometry.size) for s in geometry.starts),
        )
        for i, geometry in enumerate(_GEOMETRY)
    )
