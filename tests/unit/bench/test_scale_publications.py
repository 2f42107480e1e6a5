"""The scale benchmark's publications: the flexgpu variants publish the same devices and
counters, only the dynamic-MIG GPUs' whole-GPU devices move, and the load it writes names
devices every publication has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.scale_publications import (
    FLEXGPU_ORDERS,
    PLACEMENT_MAJOR,
    PUBLICATIONS,
    inventory,
    node_specs,
)
from bench.scale_scheduling import background


def _names(specs: list[dict[str, Any]]) -> list[str]:
    return [str(d["name"]) for s in specs for d in s.get("devices", [])]


def test_flexgpu_variants_move_only_the_dynamic_mig_whole_gpus(tmp_path: Path) -> None:
    inv = inventory("n", tmp_path)
    default = node_specs("flexgpu", "n", inv)
    whole = {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}  # the dynamic-MIG GPUs of the hollow node
    for publication in FLEXGPU_ORDERS:
        specs = node_specs(publication, "n", inv)
        names = _names(specs)
        assert sorted(names) == sorted(_names(default))
        assert [n for n in names if n not in whole] == [
            n for n in _names(default) if n not in whole
        ]
        assert [s.get("sharedCounters") for s in specs] == [
            s.get("sharedCounters") for s in default
        ]
        assert names[:4] == ["gpu-4", "gpu-5", "gpu-6", "gpu-7"]  # plain and shared GPUs first
    after_1g = _names(node_specs("flexgpu-whole-after-1g", "n", inv))
    first_1g = next(i for i, n in enumerate(after_1g) if "-mig-1g10gb-" in n)
    assert after_1g[first_1g + 28 : first_1g + 32] == sorted(whole)  # 4 GPUs x 7 placements
    assert _names(node_specs("flexgpu-whole-last", "n", inv))[-4:] == sorted(whole)


def test_placement_major_takes_every_gpus_first_placement_first(tmp_path: Path) -> None:
    inv = inventory("n", tmp_path)
    names = _names(node_specs(PLACEMENT_MAJOR, "n", inv))
    assert sorted(names) == sorted(_names(node_specs("flexgpu", "n", inv)))
    ones = [f"gpu-{g}-mig-1g10gb-{s}" for s in range(6, -1, -1) for g in range(4)]
    assert names[4 : 4 + 28] == ones
    assert names[32:36] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    sevens = [n for n in names if "-mig-7g80gb-" in n]
    assert sevens == [f"gpu-{g}-mig-7g80gb-0" for g in range(4)]


def test_the_load_names_devices_every_publication_has(tmp_path: Path) -> None:
    inv = inventory("n", tmp_path)
    for publication in PUBLICATIONS:
        names = set(_names(node_specs(publication, "n", inv)))
        busy, plain_taken = background(publication, inv), background(publication, inv, True)
        assert set(busy) <= names and set(plain_taken) <= names
        assert len(plain_taken) == len(busy) + (0 if publication == "whole-only" else 1)
        assert ("gpu-7" in plain_taken, "gpu-3" in plain_taken) == (True, False)
