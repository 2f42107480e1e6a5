"""The simulated catalog against NVIDIA's mock NVML tables, read through the NVML backend over the
NVML mock library: every whole-GPU figure and every GPU-instance profile's id, name, memory, SM
count, engine counts, instance count and placements must agree, or the difference must be listed
in docs/inventory.md with the published figure, which the catalog must then hold. A difference
the document does not list, or a listed one that no longer exists, fails the test."""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
from conftest import LibraryNode

from flexgpu.driver.gpu_catalog import GPU_CATALOG, GpuModelSpec
from flexgpu.driver.gpu_model import GpuInfo, MigProfile

DOC = Path(__file__).resolve().parents[3] / "docs" / "inventory.md"
START, END = "<!-- catalog-differential:start -->", "<!-- catalog-differential:end -->"
NOT_PUBLISHED = "not published"
# Catalog keys, in the order of the machine below; the library serves NVIDIA's mock table for each.
MODELS = (
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "H100-SXM5-80GB",
    "H200-SXM5-141GB",
    "B200-SXM6-180GB",
)

Key = tuple[str, str, str]  # catalog key, profile id ("-" for the whole GPU), field


def _placements(profile: MigProfile) -> str:
    return ", ".join(f"{p.start}:{p.size}" for p in profile.placements)


def _profile_fields(profile: MigProfile) -> dict[str, str]:
    engines = profile.engines
    return {
        "name": profile.name,
        "compute slices": str(profile.compute_slices),
        "memory MiB": str(profile.memory_mib),
        "SMs": str(profile.multiprocessors),
        "copy engines": str(engines.copy_engines),
        "decoders": str(engines.decoders),
        "encoders": str(engines.encoders),
        "JPEG decoders": str(engines.jpeg_decoders),
        "OFA": str(engines.ofa),
        "instances": str(profile.max_instances),
        "placements": _placements(profile),
    }


def _gpu_fields(product: str, memory_mib: int, arch: str, cc: str, pci_id: int) -> dict[str, str]:
    return {
        "product name": product,
        "memory MiB": str(memory_mib),
        "architecture": arch,
        "compute capability": cc,
        "PCI device id": f"0x{pci_id:08X}",
    }


def _catalog_figures(spec: GpuModelSpec) -> dict[tuple[str, str], str]:
    figures = {
        ("-", field): value
        for field, value in _gpu_fields(
            spec.product_name,
            spec.memory_mib,
            spec.architecture,
            spec.cuda_compute_capability,
            spec.pci_device_id,
        ).items()
    }
    for profile in spec.mig_profiles:
        for field, value in _profile_fields(profile).items():
            figures[(str(profile.profile_id), field)] = value
    return figures


def _mock_figures(
    gpu: GpuInfo, pci_id: int, profiles: list[MigProfile]
) -> dict[tuple[str, str], str]:
    figures = {
        ("-", field): value
        for field, value in _gpu_fields(
            gpu.product_name,
            gpu.memory_mib,
            gpu.architecture,
            gpu.cuda_compute_capability,
            pci_id,
        ).items()
    }
    for profile in profiles:
        for field, value in _profile_fields(profile).items():
            figures[(str(profile.profile_id), field)] = value
    return figures


def measured_differences(library_node: LibraryNode) -> dict[Key, tuple[str, str]]:
    """(mock, catalog) for every figure where NVIDIA's mock and the catalog disagree."""
    machine = {"gpus": [{"model": model, "migEnabled": True} for model in MODELS]}
    backend, _ = library_node(machine)
    gpus = backend.list_gpus()
    differences: dict[Key, tuple[str, str]] = {}
    for index, model in enumerate(MODELS):
        pci_id = int(
            pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).pciDeviceId
        )
        mock = _mock_figures(gpus[index], pci_id, backend.mig_profiles(index))
        ours = _catalog_figures(GPU_CATALOG[model])
        for where in sorted(mock.keys() | ours.keys()):
            theirs, mine = mock.get(where, "absent"), ours.get(where, "absent")
            if theirs != mine:
                differences[(model, *where)] = (theirs, mine)
    return differences


def documented_differences() -> dict[Key, dict[str, str]]:
    """Rows of the comparison table in docs/inventory.md, by (product, profile id, field)."""
    text = DOC.read_text()
    table = text[text.index(START) + len(START) : text.index(END)]
    rows: dict[Key, dict[str, str]] = {}
    for line in table.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or cells[0] in ("Product", "") or set(cells[0]) <= {"-", ":"}:
            continue
        product, profile, field, mock, published, ours, why = cells
        key = (product, profile, field)
        assert key not in rows, f"docs/inventory.md lists {key} twice"
        rows[key] = {"mock": mock, "published": published, "ours": ours, "why": why}
    return rows


def test_catalog_differs_from_nvidia_mock_only_where_documented(
    library_node: LibraryNode,
) -> None:
    measured = measured_differences(library_node)
    documented = documented_differences()
    unlisted = {k: v for k, v in measured.items() if k not in documented}
    stale = sorted(k for k in documented if k not in measured)
    assert not unlisted, f"differences missing from docs/inventory.md (mock, ours): {unlisted}"
    assert not stale, f"docs/inventory.md lists differences that no longer exist: {stale}"
    for key, (mock, ours) in measured.items():
        row = documented[key]
        assert (row["mock"], row["ours"]) == (mock, ours), f"{key}: table says {row}"
        assert row["why"], f"{key}: the table must say which figure is right and why"
        if row["published"] != NOT_PUBLISHED:
            assert ours == row["published"], f"{key}: the catalog must follow the published figure"


def test_table_parser_reads_the_document() -> None:
    rows = documented_differences()
    assert rows, "docs/inventory.md has no comparison rows between the markers"
    assert all(re.fullmatch(r"-|\d+", profile) for _, profile, _ in rows)
    assert {product for product, _, _ in rows} <= set(MODELS)
