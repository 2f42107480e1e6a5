"""Start-up after checkpoint faults, on the simulated node as hardware: whatever the checkpoint
suffered, what a running pod holds survives untouched and the Event says what was rebuilt.
Also: a full data dir, newer and older checkpoint versions, and a reboot."""

from __future__ import annotations

import errno
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.gpu_model import TimeSliceInterval
from flexgpu.kubelet_plugin.claims.checkpoint import marker_bytes
from flexgpu.kubelet_plugin.claims.checkpoint_envelope import canonical_json, checksum
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord
from flexgpu.kubelet_plugin.claims.startup_reconcile import ReconcileReport, reconcile_at_start
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.unit.kubelet_plugin.prepare_support import (
    BOOT_B,
    DYNAMIC_GPU,
    SHARED_GPU,
    ClaimTable,
    Node,
    device,
    mig_mps,
    share,
    time_slicing,
)

TIME_SLICED_GPU = 3


def _rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads(path.read_text())
    change(document["data"])
    document["checksum"] = checksum(document["data"])
    path.write_text(json.dumps(document))


CORRUPTIONS: dict[str, Callable[[Path], object]] = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "random-bytes": lambda p: p.write_bytes(random.Random(3).randbytes(512)),
    "wrong-checksum": lambda p: p.write_text(p.read_text().replace('"ns"', '"nx"', 1)),
    "wrong-shape": lambda p: _rewrite(p, lambda d: d.update(claim={"uid": 7, "devices": "x"})),
}

HOLDINGS: dict[str, Callable[[ClaimTable], ClaimRef]] = {
    "whole-gpu": lambda t: t.add("whole", device("gpu-0")),
    "mig-partition": lambda t: t.add("mig", device(f"gpu-{DYNAMIC_GPU}-mig-3g40gb-4")),
    "mps-share": lambda t: t.add("mps", share(f"gpu-{SHARED_GPU}", "s1", "16Gi")),
    "time-sliced": lambda t: t.add(
        "ts", device(f"gpu-{TIME_SLICED_GPU}"), configs=(time_slicing("Long"),)
    ),
    # A partition with an MPS daemon of the claim's own (it holds the partition).
    "mig-mps": lambda t: t.add(
        "migmps",
        device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-0"),
        configs=(mig_mps(defaultActiveThreadPercentage=25, defaultPinnedDeviceMemoryLimit="2Gi"),),
    ),
}
# What the plugin of schema version 1 prepared (data/checkpoint-v1): it had no MIG MPS.
SCHEMA_1_HOLDINGS = ("whole-gpu", "mig-partition", "mps-share", "time-sliced")

# What the Event says each holding was rebuilt with (MIG instances, MPS shares, time-slices).
REBUILT_COUNTS = {
    "whole-gpu": (0, 0, 0),
    "mig-partition": (1, 0, 0),
    "mps-share": (0, 1, 0),
    "time-sliced": (0, 0, 1),
    "mig-mps": (1, 1, 0),
}


@dataclass(frozen=True)
class Holding:
    """What a prepared claim holds on the node, as the hardware and the CDI dir show it."""

    mig_uuids: tuple[str | None, ...]
    mps_gpus: tuple[int, ...]
    time_slice: TimeSliceInterval
    specs: tuple[str, ...]
    # Each daemon's UUID (a GPU's, or a MIG device's) and its pipe folder.
    mps_daemons: tuple[tuple[str, str], ...] = ()


def _holding(node: Node) -> Holding:
    cdi = node.root / "cdi"
    daemons = node.backend.mps_daemons()
    return Holding(
        tuple(m.uuid for m in node.backend.list_mig_devices(DYNAMIC_GPU)),
        tuple(d.gpu_index for d in daemons),
        node.backend.time_slice(TIME_SLICED_GPU),
        tuple(sorted(p.name for p in cdi.iterdir())) if cdi.exists() else (),
        tuple(sorted((d.gpu_uuid, d.pipe_dir) for d in daemons)),
    )


def _restart(node: Node, **kw: Any) -> tuple[ReconcileReport, list[tuple[str, str]]]:
    node.restart(**kw)
    events: list[tuple[str, str]] = []
    with node.lock:
        report = reconcile_at_start(
            node.preparer, node.store, node.table, lambda r, m: events.append((r, m))
        )
    return report, events


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, ClaimTable())


def _prepare(node: Node, ref: ClaimRef) -> None:
    assert node.preparer.prepare([ref])[ref.uid].error == ""


@pytest.mark.parametrize("holding", HOLDINGS, ids=HOLDINGS.keys())
@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=CORRUPTIONS.keys())
def test_corrupt_record_rebuilds_and_leaves_what_the_pod_holds(
    node: Node, corruption: str, holding: str
) -> None:
    ref = HOLDINGS[holding](node.table)
    _prepare(node, ref)
    before = _holding(node)
    # A leftover nobody owns, so the reconcile has something it must stop.
    node.backend.start_mps_daemon(5)
    CORRUPTIONS[corruption](node.store.record_path(ref.uid))

    report, events = _restart(node)

    assert _holding(node) == before  # MIG instance (same UUID), daemon, time-slice, spec
    assert report.rebuilt == [f"ns/{ref.name}"] and report.mps_daemons_stopped == [5]
    assert report.mig_instances_destroyed == []
    ((reason, message),) = events
    mig, mps, ts = REBUILT_COUNTS[holding]
    assert reason == "CheckpointCorrupt"
    assert str(node.store.record_path(ref.uid)) in message
    assert (
        f"Rebuilt 1 prepared claim(s) (ns/{ref.name}) holding {mig} MIG instance(s), "
        f"{mps} MPS share(s) and {ts} time-slice setting(s) from the CDI specs in "
        f"{node.root / 'cdi'}, checked against the API server" in message
    )
    # The rebuilt record is written, the corrupt file kept as a copy, and unprepare
    # takes everything back.
    assert node.store.get(ref.uid) is not None
    assert list(node.store.claims_dir.glob(f"{ref.uid}.json.corrupt-*"))
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert _holding(node) == Holding((), (), TimeSliceInterval.DEFAULT, ())


def test_all_holdings_survive_a_corrupt_version_1_checkpoint(node: Node) -> None:
    refs = [make(node.table) for make in HOLDINGS.values()]
    for ref in refs:
        _prepare(node, ref)
    before = _holding(node)
    _write_version_1(node, node.store.checkpoint().claims.values())
    node.store.legacy_path.write_bytes(node.store.legacy_path.read_bytes()[:-9] + b"garbage!!")

    report, events = _restart(node)

    assert _holding(node) == before
    assert sorted(report.rebuilt) == sorted(f"ns/{r.name}" for r in refs)
    (message,) = [m for r, m in events if r == "CheckpointCorrupt"]
    assert "holding 2 MIG instance(s), 2 MPS share(s) and 1 time-slice setting(s)" in message
    assert node.store.legacy_path.read_bytes() == marker_bytes()  # the rollback guard
    assert list(node.data_dir.glob("checkpoint.json.corrupt-*"))


def test_api_down_during_rebuild_keeps_the_spec_and_what_it_names(node: Node) -> None:
    ref = HOLDINGS["mig-partition"](node.table)
    _prepare(node, ref)
    before = _holding(node)
    node.store.record_path(ref.uid).write_text("{")
    node.table.down = True

    report, _ = _restart(node)

    assert _holding(node) == before and report.rebuilt == ["ns/mig"]
    node.table.down = False
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert _holding(node).mig_uuids == ()


def test_claim_gone_from_the_api_is_not_rebuilt_and_its_leftovers_go(node: Node) -> None:
    ref = HOLDINGS["mig-partition"](node.table)
    _prepare(node, ref)
    node.store.record_path(ref.uid).write_text("{")
    del node.table.views[("ns", ref.name)]

    report, _ = _restart(node)

    assert report.rebuilt == [] and len(report.mig_instances_destroyed) == 1
    assert _holding(node) == Holding((), (), TimeSliceInterval.DEFAULT, ())


# -- versions ----------------------------------------------------------------------------


def _write_version_1(node: Node, records: Any, version: int = 1) -> None:
    """The checkpoint as plugins of schema version 1 wrote it: the whole node in one file,
    {"checksum", "data": {"version", "boot_id", "claims"}}, canonical JSON; their per-claim
    files did not exist."""
    data = {
        "version": version,
        "boot_id": node.boot_id,
        "claims": {r.uid: r.model_dump(mode="json") for r in records},
    }
    node.store.legacy_path.write_bytes(canonical_json({"checksum": checksum(data), "data": data}))
    for path in node.store.claims_dir.iterdir():
        path.unlink()


def test_version_1_checkpoint_is_migrated_keeping_prepared_claims(node: Node) -> None:
    refs = [make(node.table) for make in HOLDINGS.values()]
    for ref in refs:
        _prepare(node, ref)
    records = node.store.checkpoint().claims
    before = _holding(node)
    _write_version_1(node, records.values())

    report, events = _restart(node)

    assert events == [] and report.checkpoint_status == "migrated"
    assert sorted(report.migrated) == sorted(f"ns/{r.name}" for r in refs)
    assert node.store.checkpoint().claims == records
    assert sorted(p.name for p in node.store.claims_dir.iterdir()) == sorted(
        f"{r.uid}.json" for r in refs
    )
    assert node.store.legacy_path.read_bytes() == marker_bytes()  # the rollback guard
    assert _holding(node) == before
    assert all(not r.error for r in node.preparer.unprepare(refs).values())
    assert _holding(node) == Holding((), (), TimeSliceInterval.DEFAULT, ())


FIXTURE = Path(__file__).parent / "data" / "checkpoint-v1"


def test_files_left_by_a_schema_1_plugin_are_migrated(tmp_path: Path) -> None:
    """``data/checkpoint-v1`` holds what the schema-1 plugin wrote after preparing the four
    HOLDINGS claims: its checkpoint.json, the CDI specs and the simulated GPUs (a MIG
    instance, an MPS daemon, a Long time-slice). They are re-rooted into tmp_path; the
    checkpoint's checksum is recomputed after that, by the same rule as schema 1."""
    for folder in ("data", "cdi"):
        (tmp_path / folder).mkdir()

    def rerooted(source: Path) -> str:
        return source.read_text().replace("@ROOT@", str(tmp_path))

    (tmp_path / "data" / "simulated-gpus.json").write_text(
        rerooted(FIXTURE / "simulated-gpus.json")
    )
    for spec in (FIXTURE / "cdi").iterdir():
        (tmp_path / "cdi" / spec.name).write_text(rerooted(spec))
    document = json.loads(rerooted(FIXTURE / "checkpoint.json"))
    assert document["data"]["version"] == 1
    document["checksum"] = checksum(document["data"])
    (tmp_path / "data" / "checkpoint.json").write_bytes(canonical_json(document))
    table = ClaimTable()
    refs = [HOLDINGS[name](table) for name in SCHEMA_1_HOLDINGS]
    node = Node(tmp_path, table)
    before = _holding(node)
    assert len(before.mig_uuids) == 1 and before.mps_gpus == (SHARED_GPU,)
    assert before.time_slice == TimeSliceInterval.LONG and len(before.specs) == 4

    report, events = _restart(node)

    assert events == [] and report.checkpoint_status == "migrated"
    assert sorted(report.migrated) == sorted(f"ns/{r.name}" for r in refs)
    assert _holding(node) == before
    records = node.store.checkpoint().claims
    assert {u: r.model_dump(mode="json") for u, r in records.items()} == document["data"]["claims"]
    assert node.store.legacy_path.with_name("checkpoint.json.migrated-v1").exists()
    again = node.preparer.prepare(refs)  # already prepared: answered from the records
    assert [d.device_name for r in again.values() for d in r.devices] == [
        "gpu-0",
        f"gpu-{DYNAMIC_GPU}-mig-3g40gb-4",
        f"gpu-{SHARED_GPU}",
        f"gpu-{TIME_SLICED_GPU}",
    ]
    assert all(not r.error for r in node.preparer.unprepare(refs).values())
    assert _holding(node) == Holding((), (), TimeSliceInterval.DEFAULT, ())


def test_version_1_file_written_while_serving_is_migrated_before_the_next_call(
    node: Node,
) -> None:
    """A version-1 plugin still running during a rolling update prepared a claim."""
    old = HOLDINGS["time-sliced"](node.table)
    _prepare(node, old)
    record = node.store.get(old.uid)
    _restart(node)
    assert record is not None
    _write_version_1(node, [record])
    # The new plugin must see it: a second claim on the same GPU shares the time-slice.
    other = node.table.add("other", device("gpu-0"))
    _prepare(node, other)
    assert set(node.store.checkpoint().claims) == {old.uid, other.uid}
    assert node.store.legacy_path.read_bytes() == marker_bytes()  # the rollback guard


@pytest.mark.parametrize("where", ["record", "version-1-file"])
def test_newer_version_keeps_running_untouched_and_says_so(node: Node, where: str) -> None:
    refs = [make(node.table) for make in HOLDINGS.values()]
    for ref in refs:
        _prepare(node, ref)
    before = _holding(node)
    if where == "record":
        foreign = node.store.record_path(refs[1].uid)
        _rewrite(foreign, lambda d: d.update(version=7, claim={"future": True}))
    else:
        _write_version_1(node, node.store.checkpoint().claims.values(), version=7)
        foreign = node.store.legacy_path
    content = foreign.read_bytes()

    report, events = _restart(node)

    assert _holding(node) == before
    (message,) = [m for r, m in events if r == "CheckpointVersionUnsupported"]
    assert f"{foreign} (schema version 7)" in message
    assert "reads schema versions up to 2 and left them untouched" in message
    assert foreign.read_bytes() == content
    assert len(report.rebuilt) == (1 if where == "record" else len(refs))
    assert set(node.store.checkpoint().claims) == {r.uid for r in refs}
    assert all(not r.error for r in node.preparer.unprepare(refs).values())
    assert _holding(node) == Holding((), (), TimeSliceInterval.DEFAULT, ())
    assert foreign.read_bytes() == content


# -- a full data dir ---------------------------------------------------------------------


def _full_disk(path: Path, data: bytes) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_start_on_a_full_disk_writes_nothing_and_unprepare_frees(node: Node) -> None:
    refs = [make(node.table) for make in HOLDINGS.values()]
    for ref in refs:
        _prepare(node, ref)
    before = _holding(node)
    node.writer = _full_disk

    report, events = _restart(node)

    assert events == [] and report.write_failures == [] and _holding(node) == before
    new = node.table.add("new", device("gpu-4"))
    error = node.preparer.prepare([new])[new.uid].error
    assert error == (
        f"claim ns/new: cannot write claim record {node.store.record_path(new.uid)}: No space "
        f"left on device (ENOSPC); free space in {node.data_dir} or fix its permissions"
    )
    assert all(not r.error for r in node.preparer.unprepare(refs).values())
    assert _holding(node) == Holding((), (), TimeSliceInterval.DEFAULT, ())
    assert list(node.store.claims_dir.iterdir()) == []


def test_rebuild_on_a_full_disk_keeps_serving_from_memory_and_says_so(node: Node) -> None:
    ref = HOLDINGS["mig-partition"](node.table)
    _prepare(node, ref)
    before = _holding(node)
    node.store.record_path(ref.uid).write_text("")
    node.writer = _full_disk

    report, events = _restart(node)

    assert _holding(node) == before and report.rebuilt == ["ns/mig"]
    (message,) = [m for r, m in events if r == "CheckpointWriteFailed"]
    assert "No space left on device (ENOSPC)" in message
    assert "keeps serving with 1 record(s) held in memory" in message
    # The corrupt file stays until a rebuilt record replaces it (a crash now rebuilds again).
    assert node.store.record_path(ref.uid).read_bytes() == b""
    assert node.preparer.prepare([ref])[ref.uid].error == ""  # answered from memory
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert _holding(node).mig_uuids == ()


@pytest.fixture
def tiny_data_dir(tmp_path: Path) -> Any:
    """The node's data dir on a 64 KiB tmpfs (needs root; skipped elsewhere)."""
    mount_point = tmp_path / "data"
    mount_point.mkdir()
    if os.system(f"mount -t tmpfs -o size=64k tmpfs {mount_point} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount_point
    os.system(f"umount {mount_point}")


def test_really_full_data_dir(tiny_data_dir: Path, tmp_path: Path) -> None:
    """The same on a real filesystem with no space left."""
    node = Node(tmp_path, ClaimTable())
    ref = HOLDINGS["whole-gpu"](node.table)
    _prepare(node, ref)
    with pytest.raises(OSError, match="No space"), (tiny_data_dir / "filler").open("wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()

    report, events = _restart(node)

    assert events == [] and report.kept == ["ns/whole"]
    other = node.table.add("other", device("gpu-4"))
    assert "No space left on device (ENOSPC)" in node.preparer.prepare([other])[other.uid].error
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert list(node.store.claims_dir.iterdir()) == []


def test_clean_restart_writes_nothing(node: Node) -> None:
    for make in HOLDINGS.values():
        _prepare(node, make(node.table))
    _restart(node)  # the start that served them wrote the rollback marker
    writes: list[Path] = []
    node.writer = lambda path, data: writes.append(path)
    _restart(node)
    assert writes == []


# -- reboot ------------------------------------------------------------------------------


def test_reboot_resets_what_the_records_set_and_says_so(node: Node) -> None:
    refs = [make(node.table) for make in HOLDINGS.values()]
    for ref in refs:
        _prepare(node, ref)
    by_start = {m.placement.start: m.uuid for m in node.backend.list_mig_devices(DYNAMIC_GPU)}
    mig_uuid, mig_mps_uuid = by_start[4], by_start[0]

    report, events = _restart(node, boot_id=BOOT_B)

    assert _holding(node) == Holding((), (), TimeSliceInterval.DEFAULT, ())
    assert node.store.checkpoint().claims == {}
    assert list(node.store.claims_dir.iterdir()) == []
    assert sorted(report.stale_dropped) == sorted(f"ns/{r.name}" for r in refs)
    ((reason, message),) = events
    assert reason == "CheckpointFromEarlierBoot"
    assert f"this boot is {BOOT_B}): dropped 5 claim record(s)" in message
    assert f"reset time-slice of gpu-{TIME_SLICED_GPU} to Default" in message
    assert f"stopped the MPS daemon of gpu-{SHARED_GPU}" in message
    assert f"destroyed MIG instance 3g.40gb@4 on gpu-{DYNAMIC_GPU} ({mig_uuid})" in message
    assert f"stopped the MPS daemon of MIG device {mig_mps_uuid}" in message
    assert f"destroyed MIG instance 1g.10gb@0 on gpu-{DYNAMIC_GPU} ({mig_mps_uuid})" in message


def test_reboot_with_nothing_left_set_says_so(node: Node) -> None:
    ref = HOLDINGS["whole-gpu"](node.table)
    _prepare(node, ref)
    for spec in (node.root / "cdi").iterdir():
        spec.unlink()  # /var/run is a tmpfs: gone with the reboot

    _, events = _restart(node, boot_id=BOOT_B)

    ((_, message),) = events
    assert message.endswith("dropped 1 claim record(s) (ns/whole); reset: nothing was left set.")


def test_records_round_trip_through_a_restart(node: Node) -> None:
    refs = [make(node.table) for make in HOLDINGS.values()]
    for ref in refs:
        _prepare(node, ref)
    records: dict[str, ClaimRecord] = node.store.checkpoint().claims
    report, events = _restart(node)
    assert events == [] and sorted(report.kept) == sorted(f"ns/{r.name}" for r in refs)
    assert node.store.checkpoint().claims == records
