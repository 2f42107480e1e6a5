from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from flexgpu.kubelet_plugin.claims.checkpoint import (
    CheckpointError,
    CheckpointStore,
    CheckpointWriteError,
    marker_bytes,
)
from flexgpu.kubelet_plugin.claims.checkpoint_envelope import checksum, seal
from flexgpu.kubelet_plugin.claims.checkpoint_records import (
    SCHEMA_VERSION,
    ClaimRecord,
    ClaimState,
    CreatedResources,
    DeviceRecord,
    MigInstanceRecord,
    MpsShareRecord,
)

BOOT_A = "3f1c9a52-2b7e-4d0a-9c1e-5e8f7a6b4c3d"
BOOT_B = "8a2d4e6f-1b3c-4d5e-8f9a-0b1c2d3e4f5a"


def _boot_file(directory: Path, boot_id: str) -> Path:
    path = directory / f"boot_id-{boot_id[:4]}"
    path.write_text(boot_id + "\n")
    return path


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "data" / "checkpoint.json", _boot_file(tmp_path, BOOT_A))


def _record(uid: str, state: ClaimState = ClaimState.PREPARED) -> ClaimRecord:
    return ClaimRecord(
        uid=uid,
        namespace="team-a",
        name=f"claim-{uid}",
        state=state,
        devices=[
            DeviceRecord(
                request_names=["gpu"],
                pool_name="node-a",
                device_name="gpu-0-mig-1g.10gb-3",
                cdi_device_ids=[f"k8s.gpu.flexgpu.dev/claim={uid}"],
                share_id=None,
            )
        ],
        created=CreatedResources(
            cdi_spec_path=f"/var/run/cdi/k8s.gpu.flexgpu.dev-claim_{uid}.json",
            mig_instances=[
                MigInstanceRecord(
                    parent_uuid="GPU-1",
                    profile="1g.10gb",
                    placement_start=3,
                    gpu_instance_id=9,
                    compute_instance_id=0,
                )
            ],
            mps_share=MpsShareRecord(gpu_uuids=["GPU-1"], active_thread_percentage=50),
        ),
    )


def _rewrite(path: Path, change: Any) -> None:
    """Edit the stored document and re-seal it with a correct checksum."""
    document = json.loads(path.read_text())
    change(document["data"])
    document["checksum"] = checksum(document["data"])
    path.write_text(json.dumps(document))


def _legacy(store: CheckpointStore, boot_id: str, *records: ClaimRecord, version: int = 1) -> None:
    """A checkpoint as plugins of schema version 1 wrote it: one file for the node."""
    data = {
        "version": version,
        "boot_id": boot_id,
        "claims": {r.uid: r.model_dump(mode="json") for r in records},
    }
    store.legacy_path.parent.mkdir(parents=True, exist_ok=True)
    store.legacy_path.write_bytes(seal(data))


def test_nothing_on_disk_is_an_empty_checkpoint_for_this_boot(store: CheckpointStore) -> None:
    scan = store.scan()
    assert (scan.current, scan.stale, scan.corrupt, scan.foreign) == ({}, [], [], [])
    assert scan.legacy_status == "missing"
    assert store.checkpoint().claims == {} and store.checkpoint().boot_id == BOOT_A


def test_one_sealed_file_per_claim(store: CheckpointStore) -> None:
    store.put(_record("u1"))
    store.put(_record("u2", ClaimState.PREPARE_STARTED))
    assert sorted(p.name for p in store.claims_dir.iterdir()) == ["u1.json", "u2.json"]
    document = json.loads(store.record_path("u2").read_text())
    assert document["checksum"] == checksum(document["data"])
    assert document["data"]["version"] == SCHEMA_VERSION == 2
    assert document["data"]["boot_id"] == BOOT_A
    assert document["data"]["claim"]["state"] == "PrepareStarted"
    assert store.checkpoint().claims == {
        "u1": _record("u1"),
        "u2": _record("u2", ClaimState.PREPARE_STARTED),
    }
    # A second store (the other plugin process) reads the same.
    assert CheckpointStore(store.legacy_path, store.boot_id_path).get("u2") == store.get("u2")
    store.delete("u1")
    assert store.get("u1") is None and list(store.checkpoint().claims) == ["u2"]


def test_a_state_change_is_one_unsynced_file_write(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Records are void after a reboot and checksummed, so they are never fsynced (see the
    # module docstring); a SIGKILL still leaves old or new (test_sigkill_* below).
    syncs: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        syncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    store.put(_record("u1"))
    store.put(_record("u1", ClaimState.PREPARE_STARTED))
    assert store.get("u1") == _record("u1", ClaimState.PREPARE_STARTED)
    store.delete("u1")
    assert syncs == []
    assert [p.name for p in store.claims_dir.iterdir()] == []  # no temp file left


def test_a_sealed_file_is_the_canonical_json_of_checksum_and_data(store: CheckpointStore) -> None:
    # seal() builds the envelope around one encoding of the data; the bytes must still be what
    # a reader (this release or the schema-1 rollback guard) canonicalises and checks.
    data = {"version": 2, "boot_id": "b", "claim": {"uid": "u", "name": "é", "x": [1, None]}}
    document = json.loads(seal(data))
    assert document == {"checksum": checksum(data), "data": data}
    assert (
        seal(data)
        == json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    )


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "random-bytes": lambda p: p.write_bytes(random.Random(7).randbytes(300)),
    "wrong-checksum": lambda p: p.write_text(p.read_text().replace("claim-u1", "claim-XX")),
    "wrong-shape": lambda p: _rewrite(p, lambda d: d.update(claim=["not", "a", "record"])),
}


@pytest.mark.parametrize("damage", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_record_is_reported_and_kept_for_inspection(
    store: CheckpointStore, damage: Any
) -> None:
    store.put(_record("u1"))
    store.put(_record("u2"))
    path = store.record_path("u1")
    damage(path)
    damaged = path.read_bytes()
    scan = store.scan()
    assert [c.path for c in scan.corrupt] == [path]
    assert list(scan.current) == ["u2"]
    assert list(store.checkpoint().claims) == ["u2"]  # serving skips it
    copy = store.set_aside(scan.corrupt[0])
    assert copy is not None and copy.name.startswith("u1.json.corrupt-")
    assert copy.read_bytes() == damaged and path.exists()
    store.remove_corrupt(scan.corrupt[0], copy)
    assert not path.exists() and copy.exists()


def test_corrupt_file_replaced_by_a_rebuilt_record_is_not_removed(store: CheckpointStore) -> None:
    store.record_path("u1").parent.mkdir(parents=True)
    store.record_path("u1").write_text("garbage")
    (corrupt,) = store.scan().corrupt
    copy = store.set_aside(corrupt)
    store.put(_record("u1"))
    store.remove_corrupt(corrupt, copy)
    assert store.get("u1") == _record("u1")


def test_records_of_another_boot_are_stale(store: CheckpointStore, tmp_path: Path) -> None:
    store.put(_record("u1"))
    after_reboot = CheckpointStore(store.legacy_path, _boot_file(tmp_path, BOOT_B))
    scan = after_reboot.scan()
    assert scan.current == {} and scan.stale == [(BOOT_A, _record("u1"))]
    assert after_reboot.get("u1") is None  # never served as current
    assert after_reboot.empty().boot_id == BOOT_B


def test_newer_version_is_foreign_and_never_touched(store: CheckpointStore) -> None:
    store.put(_record("u1"))
    path = store.record_path("u1")
    # A newer plugin may also seal differently: the version decides, not the checksum.
    _rewrite(path, lambda d: d.update(version=3))
    path.write_text(path.read_text().replace("sha256:", "sha512:"))
    before = path.read_bytes()
    scan = store.scan()
    assert [(f.path, f.version) for f in scan.foreign] == [(path, 3)]
    assert scan.corrupt == [] and scan.current == {}
    store.put(_record("u1"))  # held in memory instead of overwriting
    assert store.get("u1") == _record("u1")
    store.delete("u1")
    assert path.read_bytes() == before


def test_version_1_file_is_read_for_migration(store: CheckpointStore) -> None:
    _legacy(store, BOOT_A, _record("u1"), _record("u2", ClaimState.PREPARE_STARTED))
    scan = store.scan()
    assert scan.legacy_status == "current"
    assert scan.legacy == {"u1": _record("u1"), "u2": _record("u2", ClaimState.PREPARE_STARTED)}
    assert store.migrate_legacy(scan.legacy) == []
    assert store.legacy_path.read_bytes() == marker_bytes()
    assert store.legacy_path.with_name("checkpoint.json.migrated-v1").exists()
    assert set(store.checkpoint().claims) == {"u1", "u2"}
    assert not store.legacy_changed()
    _legacy(store, BOOT_A, _record("u3"))  # an old plugin still running writes again
    assert store.legacy_changed()


@pytest.mark.parametrize(
    ("version", "status"), [(1, "current"), (2, "corrupt"), (99, "foreign")], ids=str
)
def test_version_1_file_of_a_newer_version_is_foreign(
    store: CheckpointStore, version: int, status: str
) -> None:
    _legacy(store, BOOT_A, _record("u1"), version=version)
    scan = store.scan()
    assert scan.legacy_status == status
    assert [f.version for f in scan.foreign] == ([version] if status == "foreign" else [])


def test_failed_write_names_path_and_errno_and_keeps_the_old_state(tmp_path: Path) -> None:
    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    boot = _boot_file(tmp_path, BOOT_A)
    store = CheckpointStore(tmp_path / "data" / "checkpoint.json", boot)
    store.put(_record("u1"))
    broken = CheckpointStore(store.legacy_path, boot, writer=full)
    with pytest.raises(CheckpointWriteError) as info:
        broken.put(_record("u1", ClaimState.PREPARE_STARTED))
    assert str(info.value).startswith(
        f"cannot write claim record {store.record_path('u1')}: No space left on device (ENOSPC)"
    )
    assert info.value.errno == errno.ENOSPC
    assert broken.get("u1") == _record("u1")
    broken.keep_in_memory(_record("u2"))
    assert set(broken.checkpoint().claims) == {"u1", "u2"}
    broken.delete("u1")  # works on a full disk
    assert set(broken.checkpoint().claims) == {"u2"}


def test_unknown_fields_survive_a_rewrite(store: CheckpointStore) -> None:
    store.put(_record("u1"))
    _rewrite(store.record_path("u1"), lambda d: d["claim"]["created"].update(vgpu_profile="x"))
    loaded = store.get("u1")
    assert loaded is not None
    store.put(loaded.model_copy(update={"state": ClaimState.PREPARE_STARTED}))
    data = json.loads(store.record_path("u1").read_text())["data"]
    assert data["claim"]["created"]["vgpu_profile"] == "x"


def test_uid_that_cannot_name_a_file_is_refused(store: CheckpointStore) -> None:
    with pytest.raises(CheckpointError, match="cannot name a record file"):
        store.record_path("../escape")


def test_empty_boot_id_is_an_error(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("\n")
    with pytest.raises(CheckpointError, match="empty"):
        CheckpointStore(tmp_path / "c.json", boot).empty()


def test_real_boot_id_is_readable() -> None:
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("no /proc boot id on this system")
    assert len(CheckpointStore(Path("/nonexistent/c.json")).boot_id) == 36


# --- crash safety ------------------------------------------------------------------------

CLAIMS = 8


def _marker(generation: int) -> ClaimRecord:
    # Padded, so a kill often lands inside a write.
    return ClaimRecord(
        uid="marker", namespace="ns" * 2000, name=str(generation), state=ClaimState.PREPARED
    )


def _keep_writing(store: CheckpointStore, done: Any, started: Any) -> None:
    generation = 1
    while True:
        store.put(_marker(generation))
        done.value = generation
        started.set()
        generation += 1


def test_sigkill_during_writes_leaves_old_or_new_version(store: CheckpointStore) -> None:
    for i in range(CLAIMS):
        store.put(_record(f"u{i}"))
    context = multiprocessing.get_context("fork")  # the child needs nothing but the store
    rng = random.Random(1234)
    deadline = time.monotonic() + 2.5
    kills = 0
    while kills < 25 and time.monotonic() < deadline:
        store.put(_marker(0))
        # lock=False: a writer killed while holding the lock would hang every later read.
        done, started = context.Value("q", 0, lock=False), context.Event()
        child = context.Process(target=_keep_writing, args=(store, done, started))
        child.start()
        try:
            assert started.wait(5), "writer did not start"
            time.sleep(rng.uniform(0, 0.02))
        finally:
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.join()
        kills += 1
        scan = store.scan()
        assert scan.corrupt == [], "a torn file"
        assert len(scan.current) == CLAIMS + 1
        # The last completed write, or the one in flight if its rename had happened.
        assert int(scan.current["marker"].name) in {done.value, done.value + 1}
    assert kills >= 10, f"only {kills} kills in the time budget"
