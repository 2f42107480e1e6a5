"""The soak's checks find what they claim to find: double allocations in claim records and CDI
specs, and leftovers on a quiet node. Runs in the default test run (files only, no cluster)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.soak.invariants import double_allocations, gpu_settings, leftovers


@dataclass
class Files:
    name: str
    root: Path

    @property
    def data_dir(self) -> Path:
        return self.root / "plugin-data"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"


def _node(tmp_path: Path) -> Files:
    node = Files("n1", tmp_path)
    (node.data_dir / "claims").mkdir(parents=True)
    node.cdi_dir.mkdir()
    gpus = [
        {
            "mig_enabled": False,
            "compute_mode": "Default",
            "time_slice": "Default",
            "lost": False,
            "mig_instances": [],
            "mps_running": False,
        }
        for _ in range(2)
    ]
    _state(node, gpus)
    return node


def _state(node: Files, gpus: list[dict[str, Any]]) -> None:
    (node.data_dir / "simulated-gpus.json").write_text(json.dumps({"gpus": gpus}))


def _record(
    node: Files,
    uid: str,
    devices: list[dict[str, Any]],
    mig: list[dict[str, Any]] | None = None,
    state: str = "Prepared",
) -> None:
    claim = {
        "uid": uid,
        "namespace": "ns",
        "name": uid,
        "state": state,
        "devices": [{"pool_name": "n1", **d} for d in devices],
        "created": {"mig_instances": mig or []},
    }
    (node.data_dir / "claims" / f"{uid}.json").write_text(json.dumps({"data": {"claim": claim}}))


def _mig(start: int, size: int, uuid: str) -> dict[str, Any]:
    return {
        "parent_uuid": "GPU-0",
        "parent_index": 0,
        "profile": "x",
        "placement_start": start,
        "placement_size": size,
        "uuid": uuid,
    }


def test_two_claims_on_one_whole_gpu_are_found(tmp_path: Path) -> None:
    node = _node(tmp_path)
    _record(node, "a", [{"device_name": "gpu-1"}])
    _record(node, "b", [{"device_name": "gpu-1"}])
    (problem,) = double_allocations(node)
    assert "ns/a (a) and ns/b (b) both hold [('n1', 'gpu-1')]" in problem


def test_shares_and_unfinished_prepares_are_no_double_allocation(tmp_path: Path) -> None:
    node = _node(tmp_path)
    _record(node, "a", [{"device_name": "gpu-0", "share_id": "s1"}])
    _record(node, "b", [{"device_name": "gpu-0", "share_id": "s2"}])
    _record(node, "c", [{"device_name": "gpu-1"}])
    _record(node, "d", [{"device_name": "gpu-1"}], state="PrepareStarted")
    assert double_allocations(node) == []


def test_overlapping_mig_placements_and_mig_under_a_whole_gpu_are_found(tmp_path: Path) -> None:
    node = _node(tmp_path)
    _record(node, "a", [{"device_name": "gpu-0-mig-3g40gb-0"}], [_mig(0, 4, "MIG-a")])
    _record(node, "b", [{"device_name": "gpu-0-mig-1g10gb-3"}], [_mig(3, 1, "MIG-b")])
    _record(node, "c", [{"device_name": "gpu-0-mig-1g10gb-4"}], [_mig(4, 1, "MIG-c")])
    _record(node, "d", [{"device_name": "gpu-0"}])
    problems = double_allocations(node)
    assert sum("[0,4) and ns/b (b) MIG MIG-b [3,4) overlap" in p for p in problems) == 1
    assert sum("which ns/d (d) holds whole" in p for p in problems) == 3
    assert len(problems) == 4  # a and c are side by side: no overlap


def test_a_uuid_granted_by_two_claims_cdi_specs_is_found(tmp_path: Path) -> None:
    node = _node(tmp_path)
    for uid in ("u1", "u2"):
        env = f"FLEXGPU_DEVICE_0=uuid=GPU-7;claim=ns/{uid};claimUID={uid};device=gpu-0"
        (node.cdi_dir / f"{uid}.json").write_text(json.dumps({"env": [env]}))
    share = "FLEXGPU_DEVICE_0=uuid=GPU-8;claimUID=u3;device=gpu-1;share=s"
    (node.cdi_dir / "u3.json").write_text(json.dumps({"env": [share]}))
    (node.cdi_dir / "u4.json").write_text(json.dumps({"env": [share.replace("u3", "u4")]}))
    assert double_allocations(node) == ["n1: CDI specs of claims ['u1', 'u2'] all grant GPU-7"]


def test_leftovers_name_records_specs_and_changed_gpu_settings(tmp_path: Path) -> None:
    node = _node(tmp_path)
    baseline = gpu_settings(node)
    assert leftovers(node, baseline, {0}) == []

    _record(node, "a", [{"device_name": "gpu-1"}])
    (node.cdi_dir / "spec.json").write_text("{}")
    changed = [dict(g) for g in baseline]
    changed[0] |= {"mig_enabled": True, "mig_instances": [{"uuid": "MIG-x"}]}
    changed[1] |= {"time_slice": "Long", "mps_running": True}
    _state(node, changed)
    assert leftovers(node, baseline, {0}) == [
        "n1: 1 claim record(s) left: ['a']",
        "n1: 1 CDI spec(s) left: ['spec.json']",
        "n1: GPU 0: MIG instances left: ['MIG-x']",
        "n1: GPU 1: time_slice is 'Long', was 'Default'",
        "n1: GPU 1: mps_running is True, was False",
    ]
