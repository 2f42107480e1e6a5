"""Prepare/unprepare rules, checked on real checkpoint and CDI files. Claims come from a
table standing in for the API server (the integration tests use the real one)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimState
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef, UnprepareResult

NODE = "node-a"
DRIVER = "gpu.flexgpu.dev"


class ClaimTable:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], ClaimView] = {}

    def add(
        self,
        name: str,
        *devices: AllocatedDevice,
        uid: str | None = None,
        allocated: bool = True,
        namespace: str = "ns",
    ) -> ClaimRef:
        view = ClaimView(uid or f"uid-{name}", namespace, name, allocated, tuple(devices))
        self.claims[(namespace, name)] = view
        return ClaimRef(namespace, name, view.uid)

    def get(self, namespace: str, name: str) -> ClaimView | None:
        return self.claims.get((namespace, name))


def gpu(device: str, request: str = "gpu", **kw: object) -> AllocatedDevice:
    return AllocatedDevice(request=request, driver=DRIVER, pool=NODE, device=device, **kw)  # type: ignore[arg-type]


@pytest.fixture
def table() -> ClaimTable:
    return ClaimTable()


@pytest.fixture
def preparer(tmp_path: Path, table: ClaimTable) -> ClaimPreparerImpl:
    devices = NodeDevices(SimulatedBackend.from_topology("l4-2-pcie", NODE))
    made = ClaimPreparerImpl(
        node_name=NODE,
        claims=table,
        devices=devices,
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )
    made.holders.wait_s = 0  # refusals at once (waiting: test_holder_wait.py)
    return made


def test_prepare_writes_cdi_and_records_prepared(
    preparer: ClaimPreparerImpl, table: ClaimTable
) -> None:
    ref = table.add("c", gpu("gpu-1", request="gpu/l4"))
    (result,) = preparer.prepare([ref]).values()
    assert result.error == ""
    (device,) = result.devices
    assert (device.pool_name, device.device_name) == (NODE, "gpu-1")
    assert device.request_names == ("gpu",)  # subrequest suffix stripped
    assert device.cdi_device_ids == (
        f"{DRIVER}/claim=uid-c-gpu-1",
        f"{DRIVER}/claim=uid-c_metadata_gpu",  # the request's device metadata file
    )
    spec = json.loads(preparer.spec_path("uid-c").read_text())
    cdi, metadata = spec["devices"]
    assert cdi["name"] == "uid-c-gpu-1"
    assert metadata["name"] == "uid-c_metadata_gpu"
    (own,) = cdi["containerEdits"]["env"]
    assert own.startswith("FLEXGPU_DEVICE_UID_C_GPU_1=uuid=GPU-")
    # The boot it was written in: a rebuild after a power loss never trusts an older one.
    boot = preparer._store.boot_id
    assert own.endswith(f";claim=ns/c;claimUID=uid-c;device=gpu-1;boot={boot}")
    # The NVIDIA runtime is told to add nothing: CDI alone decides what the container gets.
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert preparer.load_checkpoint().claims["uid-c"].state == ClaimState.PREPARED
    # Idempotent: the same answer again, nothing rewritten.
    assert preparer.prepare([ref])["uid-c"] == result


def test_a_prepare_syncs_only_the_cdi_spec_and_metadata_and_an_unprepare_nothing(
    preparer: ClaimPreparerImpl, table: ClaimTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The records before and after are unsynced (checkpoint.py says why); the data of the spec
    # and of the request's device metadata file is synced because the container runtime and
    # the container read them unchecked.
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    ref = table.add("c", gpu("gpu-1"))
    assert preparer.prepare([ref])["uid-c"].error == ""
    assert len(synced) == 2
    assert Path(synced[0]).parent == preparer.metadata.root / "uid-c" / "gpu"
    assert Path(synced[1]).parent == preparer.cdi_dir
    assert preparer.unprepare([ref])["uid-c"] == UnprepareResult()
    assert len(synced) == 2


def test_only_our_driver_and_pool_are_prepared(
    preparer: ClaimPreparerImpl, table: ClaimTable
) -> None:
    ref = table.add(
        "mixed",
        gpu("gpu-0"),
        AllocatedDevice("nic", "net.example.com", NODE, "eth0"),
        AllocatedDevice("gpu", DRIVER, "other-node", "gpu-0"),
    )
    (result,) = preparer.prepare([ref]).values()
    assert [d.device_name for d in result.devices] == ["gpu-0"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda t: ClaimRef("ns", "missing", "u1"), "claim ns/missing not found"),
        (
            lambda t: (t.add("c", gpu("gpu-0"), uid="new"), ClaimRef("ns", "c", "old"))[1],
            "claim ns/c has UID new, not old: it was deleted and re-created",
        ),
        (lambda t: t.add("c", allocated=False), "claim ns/c is not allocated"),
        (
            lambda t: t.add("c", gpu("gpu-9")),
            "device gpu-9 (request gpu) is not published by node node-a",
        ),
    ],
)
def test_refusals_are_per_claim_and_name_the_reason(
    preparer: ClaimPreparerImpl, table: ClaimTable, setup: object, message: str
) -> None:
    bad = setup(table)  # type: ignore[operator]
    good = table.add("fine", gpu("gpu-1"))
    results = preparer.prepare([bad, good])
    assert results[bad.uid].error.startswith(message)
    assert results[good.uid].error == ""
    assert list(preparer.cdi_dir.iterdir()) == [preparer.spec_path(good.uid)]


def test_device_prepared_for_another_claim_is_refused_unless_admin_access(
    preparer: ClaimPreparerImpl, table: ClaimTable
) -> None:
    first = table.add("first", gpu("gpu-0"))
    assert preparer.prepare([first])[first.uid].error == ""
    second = table.add("second", gpu("gpu-0"))
    assert preparer.prepare([second])[second.uid].error == (
        "device gpu-0 is already prepared for claim ns/first (uid-first)"
    )
    monitor = table.add("monitor", gpu("gpu-0", admin_access=True))
    assert preparer.prepare([monitor])[monitor.uid].error == ""


def test_device_conflict_names_no_claim_of_another_namespace(
    preparer: ClaimPreparerImpl, table: ClaimTable, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal reaches the refused claim's namespace (its pod's Events): a holding claim
    of another namespace is not named there; the plugin's log names it."""
    held = table.add("secret-job", gpu("gpu-0"), namespace="team-a")
    assert preparer.prepare([held])[held.uid].error == ""
    caplog.set_level(logging.INFO, logger="flexgpu.kubelet_plugin.claims.preparer")
    other = table.add("mine", gpu("gpu-0"), namespace="team-b")
    error = preparer.prepare([other])[other.uid].error
    assert error == "device gpu-0 is already prepared for a claim of another namespace"
    assert "team-a" not in error and "secret-job" not in error
    assert "team-a/secret-job (uid-secret-job)" in caplog.text


def test_unprepare_works_without_the_claim_and_for_unknown_claims(
    preparer: ClaimPreparerImpl, table: ClaimTable
) -> None:
    ref = table.add("c", gpu("gpu-0"))
    preparer.prepare([ref])
    del table.claims[("ns", "c")]  # the claim object is gone by now
    results = preparer.unprepare([ref, ClaimRef("ns", "never", "u-x")])
    assert results == {ref.uid: UnprepareResult(), "u-x": UnprepareResult()}
    assert not preparer.spec_path(ref.uid).exists()
    assert preparer.load_checkpoint().claims == {}


def test_reconcile_rolls_back_half_done_and_removes_orphans(
    preparer: ClaimPreparerImpl, table: ClaimTable, tmp_path: Path
) -> None:
    done = table.add("done", gpu("gpu-0"))
    half = table.add("half", gpu("gpu-1"))
    preparer.prepare([done, half])
    store = CheckpointStore(tmp_path / "data" / "checkpoint.json")
    record = store.get(half.uid)
    assert record is not None
    store.put(record.model_copy(update={"state": ClaimState.PREPARE_STARTED}))
    orphan = preparer.cdi_dir / f"{DRIVER}-claim_0000-orphan.json"
    orphan.write_text("{}")
    (preparer.cdi_dir / ".tmp-left-by-a-crash.tmp").write_text("")

    report = reconcile_at_start(preparer, store, table)
    assert report.rolled_back == ["ns/half"] and report.kept == ["ns/done"]
    assert report.orphan_specs_removed == [orphan.name]
    assert sorted(p.name for p in preparer.cdi_dir.iterdir()) == [preparer.spec_path(done.uid).name]
    assert set(preparer.load_checkpoint().claims) == {done.uid}


def test_corrupt_checkpoint_is_rebuilt_from_cdi_specs_and_claims(
    preparer: ClaimPreparerImpl, table: ClaimTable, tmp_path: Path
) -> None:
    alive = table.add("alive", gpu("gpu-0"))
    gone = table.add("gone", gpu("gpu-1"))
    preparer.prepare([alive, gone])
    del table.claims[("ns", "gone")]
    store = CheckpointStore(tmp_path / "data" / "checkpoint.json")
    for uid in (alive.uid, gone.uid):
        store.record_path(uid).write_text("{not json")
    events: list[tuple[str, str]] = []
    report = reconcile_at_start(preparer, store, table, lambda r, m: events.append((r, m)))
    assert report.rebuilt == ["ns/alive"]
    assert [e[0] for e in events] == ["CheckpointCorrupt"]
    assert set(store.checkpoint().claims) == {alive.uid}
    assert not preparer.spec_path(gone.uid).exists()
