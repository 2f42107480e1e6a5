from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    CorruptCheckpoint,
    CreatedResources,
    DeviceRecord,
    LoadStatus,
    MigInstanceRecord,
    MpsShareRecord,
    UnsupportedCheckpointVersion,
    checksum,
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


def test_missing_file_gives_an_empty_checkpoint_for_this_boot(store: CheckpointStore) -> None:
    result = store.load()
    assert result.status is LoadStatus.MISSING
    assert result.checkpoint == Checkpoint(boot_id=BOOT_A)


def test_round_trip(store: CheckpointStore) -> None:
    checkpoint = (
        store.empty()
        .with_claim(_record("u1"))
        .with_claim(_record("u2", ClaimState.PREPARE_STARTED))
    )
    store.save(checkpoint)
    result = store.load()
    assert result.status is LoadStatus.CURRENT
    assert result.checkpoint == checkpoint
    document = json.loads(store.path.read_text())
    assert document["checksum"] == checksum(document["data"])
    assert document["data"]["boot_id"] == BOOT_A
    assert document["data"]["claims"]["u2"]["state"] == "PrepareStarted"
    assert result.checkpoint.without_claim("u1").claims.keys() == {"u2"}
    assert checkpoint.claims.keys() == {"u1", "u2"}  # derived copies leave the original alone


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(b'{"checksum": "sha256:00", "da'), "not JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe"), "not JSON"),
        (lambda p: p.write_text("[]"), "no 'data' object"),
        (
            lambda p: p.write_text(p.read_text().replace("claim-u1", "claim-XX")),
            "checksum mismatch",
        ),
        (
            lambda p: _rewrite(p, lambda d: d["claims"]["u1"].update(state="Bogus")),
            "invalid content",
        ),
    ],
    ids=["truncated", "binary", "no-data", "tampered", "invalid-state"],
)
def test_corrupt_file_is_moved_aside(store: CheckpointStore, damage: Any, reason: str) -> None:
    store.save(store.empty().with_claim(_record("u1")))
    damage(store.path)
    damaged = store.path.read_bytes()
    with pytest.raises(CorruptCheckpoint) as info:
        store.load()
    assert reason in str(info.value)
    assert not store.path.exists()
    moved = info.value.moved_to
    assert moved is not None and moved.name.startswith("checkpoint.json.corrupt-")
    assert moved.read_bytes() == damaged
    # The next start begins afresh instead of tripping over the same file again.
    assert store.load().status is LoadStatus.MISSING


def test_two_corruptions_keep_both_files(store: CheckpointStore) -> None:
    moved = []
    for _ in range(2):
        store.path.parent.mkdir(parents=True, exist_ok=True)
        store.path.write_text("garbage")
        with pytest.raises(CorruptCheckpoint) as info:
            store.load()
        moved.append(info.value.moved_to)
    assert len(set(moved)) == 2
    assert all(p is not None and p.exists() for p in moved)


def test_other_boot_is_reported_stale(store: CheckpointStore, tmp_path: Path) -> None:
    store.save(store.empty().with_claim(_record("u1")))
    after_reboot = CheckpointStore(store.path, _boot_file(tmp_path, BOOT_B))
    result = after_reboot.load()
    assert result.status is LoadStatus.STALE
    assert result.checkpoint.boot_id == BOOT_A
    assert list(result.checkpoint.claims) == ["u1"]
    assert after_reboot.empty().boot_id == BOOT_B


def test_newer_schema_is_refused_and_left_in_place(store: CheckpointStore) -> None:
    store.save(store.empty())
    _rewrite(store.path, lambda d: d.update(version=2))
    with pytest.raises(UnsupportedCheckpointVersion, match="schema version 2"):
        store.load()
    assert store.path.exists()


def test_unknown_fields_survive_a_rewrite(store: CheckpointStore) -> None:
    store.save(store.empty().with_claim(_record("u1")))
    _rewrite(store.path, lambda d: d["claims"]["u1"]["created"].update(vgpu_profile="x"))
    loaded = store.load().checkpoint
    store.save(loaded.with_claim(_record("u2")))
    data = json.loads(store.path.read_text())["data"]
    assert data["claims"]["u1"]["created"]["vgpu_profile"] == "x"


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

CLAIMS = 80  # ~45 KiB of JSON, so a kill often lands inside a write


def _generation(checkpoint: Checkpoint) -> int:
    return int(checkpoint.claims["marker"].name)


def _with_generation(base: Checkpoint, generation: int) -> Checkpoint:
    marker = ClaimRecord(uid="marker", namespace="ns", name=str(generation), state="Prepared")
    return base.with_claim(marker)


def _keep_writing(store: CheckpointStore, base: Checkpoint, done: Any, started: Any) -> None:
    generation = 1
    while True:
        store.save(_with_generation(base, generation))
        done.value = generation
        started.set()
        generation += 1


def test_sigkill_during_writes_leaves_old_or_new_version(store: CheckpointStore) -> None:
    base = store.empty()
    for i in range(CLAIMS):
        base = base.with_claim(_record(f"u{i}"))
    context = multiprocessing.get_context("fork")  # the child needs nothing but the store
    rng = random.Random(1234)
    deadline = time.monotonic() + 2.5
    kills = 0
    while kills < 25 and time.monotonic() < deadline:
        store.save(_with_generation(base, 0))
        # lock=False: a writer killed while holding the lock would hang every later read.
        done, started = context.Value("q", 0, lock=False), context.Event()
        child = context.Process(target=_keep_writing, args=(store, base, done, started))
        child.start()
        try:
            assert started.wait(5), "writer did not start"
            time.sleep(rng.uniform(0, 0.02))
        finally:
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.join()
        kills += 1
        result = store.load()  # raises CorruptCheckpoint on a torn file
        assert result.status is LoadStatus.CURRENT
        assert len(result.checkpoint.claims) == CLAIMS + 1
        # The last completed write, or the one in flight if its rename had happened.
        assert _generation(result.checkpoint) in {done.value, done.value + 1}
    assert kills >= 10, f"only {kills} kills in the time budget"
