"""What the soak checks on a simulated node, read straight from the node's files: the plugin's
claim records (<data dir>/claims/*.json), its CDI specs and the simulated GPUs' state file.

Two prepared claims must never hold the same exclusive device: the same whole GPU, the same
device name, overlapping MIG placements on one GPU, or a whole GPU and a MIG partition of it.
Shares of a shared GPU (a share id) are the one thing several claims may hold at once."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, Protocol


class SimulatedGpuNode(Protocol):
    """The parts of tools.cluster.gpu_node.SimulatedGpuNode read here: its files."""

    name: str

    @property
    def data_dir(self) -> Path: ...

    @property
    def cdi_dir(self) -> Path: ...


_DEVICE_ENV = re.compile(r'"FLEXGPU_DEVICE_\w+=([^"]*)"')
_WHOLE_GPU = re.compile(r"^gpu-(\d+)$")

# Per GPU, what must be as it was before the churn (counters such as mps_starts may grow).
_SETTINGS = ("compute_mode", "time_slice", "lost", "mps_running", "mig_instances")


@dataclass
class Footprint:
    """The exclusive hardware one prepared claim holds on a node."""

    claim: str
    devices: set[tuple[str, str]] = field(default_factory=set)
    whole_gpus: set[int] = field(default_factory=set)
    # (parent GPU index or uuid, first slice, slice count, instance uuid)
    mig: list[tuple[str, int, int, str]] = field(default_factory=list)


def claim_records(node: SimulatedGpuNode) -> dict[str, dict[str, Any]]:
    """The node's claim records by UID; a record unlinked while it is read is skipped (unprepare
    raced the read), anything unreadable is left to raise: a record must always parse."""
    records: dict[str, dict[str, Any]] = {}
    for path in sorted((node.data_dir / "claims").glob("*.json")):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        claim = json.loads(text)["data"]["claim"]
        records[claim["uid"]] = claim
    return records


def cdi_spec_files(node: SimulatedGpuNode) -> list[Path]:
    return sorted(node.cdi_dir.glob("*.json")) if node.cdi_dir.exists() else []


def corrupt_copies(node: SimulatedGpuNode) -> list[str]:
    """Copies the plugin kept of records it found corrupt: a kill must never cause one."""
    claims = node.data_dir / "claims"
    return sorted(p.name for p in claims.glob("*.corrupt-*")) if claims.exists() else []


def footprint(record: dict[str, Any]) -> Footprint:
    fp = Footprint(claim=f"{record['namespace']}/{record['name']} ({record['uid']})")
    for device in record.get("devices", []):
        if device.get("share_id") or device.get("admin_access"):
            continue
        fp.devices.add((device["pool_name"], device["device_name"]))
        whole = _WHOLE_GPU.match(device["device_name"])
        if whole:
            fp.whole_gpus.add(int(whole.group(1)))
    for mig in record.get("created", {}).get("mig_instances", []):
        parent = mig.get("parent_index")
        fp.mig.append(
            (
                str(parent if parent is not None else mig["parent_uuid"]),
                int(mig["placement_start"]),
                int(mig.get("placement_size") or 1),
                str(mig.get("uuid")),
            )
        )
    return fp


def double_allocations(node: SimulatedGpuNode) -> list[str]:
    """Every pair of prepared claims on the node that hold the same exclusive hardware."""
    prepared = [r for r in claim_records(node).values() if r["state"] == "Prepared"]
    problems: list[str] = []
    for a, b in combinations([footprint(r) for r in prepared], 2):
        shared = a.devices & b.devices
        if shared:
            problems.append(f"{node.name}: {a.claim} and {b.claim} both hold {sorted(shared)}")
        for x, y in ((a, b), (b, a)):
            for parent, _, _, uuid in x.mig:
                if parent.isdigit() and int(parent) in y.whole_gpus:
                    problems.append(
                        f"{node.name}: {x.claim} holds MIG {uuid} on GPU {parent}, "
                        f"which {y.claim} holds whole"
                    )
        for pa, sa, na, ua in a.mig:
            for pb, sb, nb, ub in b.mig:
                if pa == pb and sa < sb + nb and sb < sa + na:
                    problems.append(
                        f"{node.name}: {a.claim} MIG {ua} [{sa},{sa + na}) and {b.claim} MIG "
                        f"{ub} [{sb},{sb + nb}) overlap on GPU {pa}"
                    )
    return problems + _cdi_double_grants(node)


def _cdi_double_grants(node: SimulatedGpuNode) -> list[str]:
    """A GPU or MIG uuid that the CDI specs of two claims grant, neither as a share."""
    holders: dict[str, set[str]] = {}
    for path in cdi_spec_files(node):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        for value in _DEVICE_ENV.findall(text):
            fields = dict(p.split("=", 1) for p in value.split(";") if "=" in p)
            if "share" in fields:
                continue
            holders.setdefault(fields.get("uuid", "?"), set()).add(fields.get("claimUID", "?"))
    return [
        f"{node.name}: CDI specs of claims {sorted(claims)} all grant {uuid}"
        for uuid, claims in sorted(holders.items())
        if len(claims) > 1
    ]


def in_use(node: SimulatedGpuNode) -> tuple[int, int]:
    """(prepared claim records, device grants in CDI specs) on the node now: shows that the
    checks above had something to check."""
    prepared = sum(1 for r in claim_records(node).values() if r["state"] == "Prepared")
    grants = 0
    for path in cdi_spec_files(node):
        try:
            grants += len(_DEVICE_ENV.findall(path.read_text()))
        except FileNotFoundError:
            continue
    return prepared, grants


def gpu_settings(node: SimulatedGpuNode) -> list[dict[str, Any]]:
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    return [{k: gpu[k] for k in (*_SETTINGS, "mig_enabled")} for gpu in state["gpus"]]


def leftovers(
    node: SimulatedGpuNode, baseline: list[dict[str, Any]], dynamic_mig: set[int]
) -> list[str]:
    """What is left on a quiet node (no pods): records, CDI specs, corrupt copies, and every
    GPU setting that differs from before the churn. A dynamic-MIG GPU may stay in MIG mode
    (the mode is the GPU's published shape, not a claim's), but must have no instance left."""
    problems: list[str] = []
    records = claim_records(node)
    if records:
        problems.append(f"{node.name}: {len(records)} claim record(s) left: {sorted(records)}")
    specs = [p.name for p in cdi_spec_files(node)]
    if specs:
        problems.append(f"{node.name}: {len(specs)} CDI spec(s) left: {specs}")
    corrupt = corrupt_copies(node)
    if corrupt:
        problems.append(f"{node.name}: corrupt record copies: {corrupt}")
    for index, (before, now) in enumerate(zip(baseline, gpu_settings(node), strict=True)):
        if index in dynamic_mig and now["mig_instances"]:
            uuids = [m["uuid"] for m in now["mig_instances"]]
            problems.append(f"{node.name}: GPU {index}: MIG instances left: {uuids}")
        for key in _SETTINGS:
            if before[key] != now[key] and not (index in dynamic_mig and key == "mig_instances"):
                problems.append(
                    f"{node.name}: GPU {index}: {key} is {now[key]!r}, was {before[key]!r}"
                )
    return problems
