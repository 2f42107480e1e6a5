"""Sharing a MIG device through prepare.

TimeSlicing is accepted as NVIDIA's DRA driver accepts it: the containers of the claim share
the MIG device the way CUDA shares any device among processes, and nothing is set on the node
(a MIG device has no time-slice interval, and the parent GPU's interval is not the claim's to
change).

MPS gives the claim an MPS control daemon of its own, as NVIDIA's driver does: started with
CUDA_VISIBLE_DEVICES naming the claim's MIG devices, its own folders and the claim's limits
(per-device keys index the devices in UUID order). The parent GPU's compute mode and
time-slice are left alone: its other partitions belong to other claims. Unprepare stops the
daemon, then destroys a partition prepare created (the simulator, like NVML, refuses to
destroy an instance an MPS daemon holds). A SIGKILL between any two steps leaves nothing
behind once the plugin has started again, and a restart keeps the daemon of a claim that
survives.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.gpu_model import ComputeMode, MigDevice, TimeSliceInterval
from flexgpu.driver.node_policy import GpuMode
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimState
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.unit.kubelet_plugin.prepare_support import (
    API,
    DRIVER,
    DYNAMIC_GPU,
    NODE,
    ClaimTable,
    Node,
    device,
    mig_mps,
)

MIG_DEVICE = "gpu-0-mig-1g10gb-0"


def _claim(claims: ClaimTable, name: str, parameters: dict[str, Any]) -> ClaimRef:
    """A claim holding the MIG device, with one opaque config from the claim."""
    entry = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}
    return claims.add(name, device(MIG_DEVICE), configs=(entry,))


def _preparer(
    tmp_path: Path,
    backend: SimulatedBackend,
    claims: ClaimTable,
    devices: NodeDevices | None = None,
) -> ClaimPreparerImpl:
    return ClaimPreparerImpl(
        node_name=NODE,
        claims=claims,
        devices=devices or NodeDevices(backend, dynamic_mig={0}),
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )


def _backend(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend.from_topology("hgx-h100-8", NODE, state_path=tmp_path / "gpus.json")


def _spec(preparer: ClaimPreparerImpl, uid: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(preparer.spec_path(uid).read_text())
    return spec


def _env(preparer: ClaimPreparerImpl, uid: str, index: int = 0) -> dict[str, str]:
    edits = _spec(preparer, uid)["devices"][index]["containerEdits"]
    return dict(e.split("=", 1) for e in edits["env"])


def _mounts(preparer: ClaimPreparerImpl, uid: str, index: int = 0) -> dict[str, str]:
    edits = _spec(preparer, uid)["devices"][index]["containerEdits"]
    return {m["containerPath"]: m["hostPath"] for m in edits.get("mounts", [])}


def _parent_untouched(backend: SimulatedBackend, index: int) -> None:
    """No exclusive-process mode, no interval, no whole-GPU daemon on the parent."""
    assert backend.get_compute_mode(index) == ComputeMode.DEFAULT
    assert backend.time_slice(index) == TimeSliceInterval.DEFAULT
    assert all(d.gpu_uuid.startswith("MIG-") for d in backend.mps_daemons())


# -- time-slicing ----------------------------------------------------------------------


def test_time_slicing_on_a_mig_device_prepares_sets_nothing_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    backend, claims = _backend(tmp_path), ClaimTable()
    preparer = _preparer(tmp_path, backend, claims)
    sharing = {"strategy": "TimeSlicing"}
    ref = _claim(claims, "ts", {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": sharing})
    assert preparer.prepare([ref])[ref.uid].error == ""
    (created,) = backend.list_mig_devices(0)
    env = _env(preparer, ref.uid)
    (own,) = [v for k, v in env.items() if k.startswith("FLEXGPU_DEV")]
    assert own.startswith(f"uuid={created.uuid};") and "timeSlice" not in own
    assert not any(k.startswith("CUDA_MPS_") for k in env)
    # The parent GPU keeps its own settings: no interval, no MPS, no compute mode change.
    _parent_untouched(backend, 0)
    assert backend.mps_daemons() == []

    restarted_backend = _backend(tmp_path)
    restarted = _preparer(tmp_path, restarted_backend, claims)
    reconcile_at_start(restarted, CheckpointStore(tmp_path / "data" / "checkpoint.json"), claims)
    assert [m.uuid for m in restarted_backend.list_mig_devices(0)] == [created.uuid]
    assert restarted.prepare([ref])[ref.uid].error == ""  # kubelet asks again: same device
    assert [m.uuid for m in restarted_backend.list_mig_devices(0)] == [created.uuid]

    restarted.unprepare([ref])
    assert restarted_backend.list_mig_devices(0) == []
    assert restarted_backend.time_slice(0) == TimeSliceInterval.DEFAULT


# -- MPS on a dynamic MIG partition ------------------------------------------------------


def test_mps_on_a_dynamic_partition_starts_a_daemon_of_the_claims_own(tmp_path: Path) -> None:
    backend, claims = _backend(tmp_path), ClaimTable()
    preparer = _preparer(tmp_path, backend, claims)
    mps = {"defaultActiveThreadPercentage": 30, "defaultPinnedDeviceMemoryLimit": "4Gi"}
    sharing = {"strategy": "MPS", "mpsConfig": mps}
    ref = _claim(claims, "mps", {"apiVersion": API, "kind": "MigConfig", "sharing": sharing})

    assert preparer.prepare([ref])[ref.uid].error == ""

    (created,) = backend.list_mig_devices(0)
    assert created.uuid is not None
    # The daemon sees the MIG device, by its UUID, and has the claim's limits as defaults.
    started = backend.mig_mps_daemon(created.uuid)
    assert started is not None
    assert started.device_uuids == [created.uuid]
    assert started.active_thread_percentage == 30
    assert started.pinned_memory_mib == {created.uuid: 4096}
    (daemon,) = backend.mps_daemons()
    assert (daemon.gpu_index, daemon.gpu_uuid) == (0, created.uuid)
    _parent_untouched(backend, 0)
    # The container gets the daemon's folders and the limits, as a whole GPU's client does.
    env = _env(preparer, ref.uid)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
    assert "CUDA_MPS_LOG_DIRECTORY" not in env  # the daemon's log is not the client's
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert _mounts(preparer, ref.uid) == {
        daemon.pipe_dir: daemon.pipe_dir,
        "/dev/shm": daemon.shm_dir,
    }
    share = preparer.load_checkpoint().claims[ref.uid].created.mps_share
    assert share is not None and share.mig and share.gpu_uuids == [created.uuid]
    assert (share.gpu_index, share.pipe_dir, share.devices) == (0, daemon.pipe_dir, [MIG_DEVICE])
    assert share.pinned_memory_limits == {"0": "4096Mi"}

    # Stopped first (it holds the partition), then the partition goes.
    assert preparer.unprepare([ref])[ref.uid].error == ""
    assert backend.mps_daemons() == [] and backend.list_mig_devices(0) == []
    _parent_untouched(backend, 0)


def test_unprepare_that_cannot_stop_the_daemon_keeps_the_partition_and_the_record(
    tmp_path: Path,
) -> None:
    backend, claims = _backend(tmp_path), ClaimTable()
    preparer = _preparer(tmp_path, backend, claims)
    ref = _claim(
        claims, "mps", {"apiVersion": API, "kind": "MigConfig", "sharing": {"strategy": "MPS"}}
    )
    assert preparer.prepare([ref])[ref.uid].error == ""
    backend.faults.fail_next("stop_mig_mps_daemon")
    assert "stop_mig_mps_daemon" in preparer.unprepare([ref])[ref.uid].error
    assert len(backend.list_mig_devices(0)) == 1 and len(backend.mps_daemons()) == 1
    assert ref.uid in preparer.load_checkpoint().claims  # the kubelet retries
    assert preparer.unprepare([ref])[ref.uid].error == ""
    assert backend.list_mig_devices(0) == [] and backend.mps_daemons() == []


def test_a_per_device_key_naming_no_device_fails_before_anything_is_created(
    tmp_path: Path,
) -> None:
    backend, claims = _backend(tmp_path), ClaimTable()
    preparer = _preparer(tmp_path, backend, claims)
    mps = {"defaultPerDevicePinnedMemoryLimit": {"1": "2Gi"}}
    sharing = {"strategy": "MPS", "mpsConfig": mps}
    ref = _claim(claims, "bad", {"apiVersion": API, "kind": "MigConfig", "sharing": sharing})
    error = preparer.prepare([ref])[ref.uid].error
    assert error == (
        'claim ns/bad: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: key "1" matches no '
        "device of the claim; allowed: an index from 0 to 0 (the devices in UUID order), or "
        f"the name or UUID of a device the config applies to ({MIG_DEVICE} (UUID given when "
        "it is created))"
    )
    assert backend.list_mig_devices(0) == [] and backend.mps_daemons() == []
    assert preparer.load_checkpoint().claims == {}


def test_mps_over_two_configs_or_with_a_whole_gpu_is_refused(tmp_path: Path) -> None:
    """A container talks to one MPS daemon: a claim's MPS devices must share one."""
    node = Node(tmp_path, ClaimTable())
    first, second = (device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-{i}", f"r{i}") for i in (0, 1))
    one, other = mig_mps(), mig_mps(defaultActiveThreadPercentage=10)
    one["requests"], other["requests"] = ["r0"], ["r1"]
    ref = node.table.add("two", first, second, configs=(one, other))
    error = node.preparer.prepare([ref])[ref.uid].error
    assert error.startswith(
        f"claim ns/two uses MPS on MIG devices gpu-{DYNAMIC_GPU}-mig-1g10gb-0 and on MIG "
        f"devices gpu-{DYNAMIC_GPU}-mig-1g10gb-1; a container talks to one MPS daemon"
    )
    whole = {**mig_mps(), "requests": ["r0"]}
    whole["opaque"]["parameters"] = {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS"},
    }
    ref = node.table.add(
        "mixed",
        device("gpu-0", "r0"),
        device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-2", "r1"),
        configs=(whole, {**mig_mps(), "requests": ["r1"]}),
    )
    error = node.preparer.prepare([ref])[ref.uid].error
    assert error.startswith(
        f"claim ns/mixed uses MPS on gpu-0 and on MIG devices gpu-{DYNAMIC_GPU}-mig-1g10gb-2"
    )
    assert node.backend.list_mig_devices(DYNAMIC_GPU) == [] and node.backend.mps_daemons() == []


def test_two_mig_devices_of_one_claim_share_its_daemon_keyed_as_nvidia_keys_them(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, ClaimTable())
    names = [f"gpu-{DYNAMIC_GPU}-mig-1g10gb-{i}" for i in (0, 1)]
    config = mig_mps(
        defaultPinnedDeviceMemoryLimit="2Gi", defaultPerDevicePinnedMemoryLimit={"1": "3Gi"}
    )
    ref = node.table.add("pair", *(device(n) for n in names), configs=(config,))
    assert node.preparer.prepare([ref])[ref.uid].error == ""

    uuids = sorted(m.uuid or "" for m in node.backend.list_mig_devices(DYNAMIC_GPU))
    started = node.backend.mig_mps_daemon(uuids[0])
    assert started is not None and started.device_uuids == uuids
    # "1" is the second device by UUID order, whichever placement it sits at.
    assert started.pinned_memory_mib == {uuids[0]: 2048, uuids[1]: 3072}
    (daemon,) = node.backend.mps_daemons()
    for index in (0, 1):
        env = _env(node.preparer, ref.uid, index)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M,1=3072M"
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert node.backend.mps_daemons() == [] and node.backend.list_mig_devices(DYNAMIC_GPU) == []


# -- MPS on a static MIG device ----------------------------------------------------------


def _static_layout(backend: SimulatedBackend) -> list[MigDevice]:
    """GPU 0 with MIG on and two 1g.10gb instances that exist before any claim."""
    backend.set_mig_mode(0, True)
    (profile,) = [p for p in backend.mig_profiles(0) if p.name == "1g.10gb"]
    return [backend.create_mig_device(0, profile.profile_id, p) for p in profile.placements[:2]]


def test_mps_on_a_static_mig_device_stops_the_daemon_and_keeps_the_device(
    tmp_path: Path,
) -> None:
    backend, claims = _backend(tmp_path), ClaimTable()
    instances = _static_layout(backend)
    devices = NodeDevices(backend)
    devices.set_modes({0: GpuMode.MIG})
    preparer = _preparer(tmp_path, backend, claims, devices)
    target = instances[1]
    assert target.uuid is not None
    # A static device's UUID is known before prepare: a key may name it.
    mps = {
        "defaultActiveThreadPercentage": 60,
        "defaultPerDevicePinnedMemoryLimit": {target.uuid: "1Gi"},
    }
    parameters = {
        "apiVersion": API,
        "kind": "MigConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": mps},
    }
    entry = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}
    ref = claims.add("static", device("gpu-0-mig-1g10gb-1"), configs=(entry,))

    assert preparer.prepare([ref])[ref.uid].error == ""

    started = backend.mig_mps_daemon(target.uuid)
    assert started is not None and started.device_uuids == [target.uuid]
    assert started.active_thread_percentage == 60
    assert started.pinned_memory_mib == {target.uuid: 1024}
    assert _env(preparer, ref.uid)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    _parent_untouched(backend, 0)

    restarted = _preparer(tmp_path, _backend(tmp_path), claims, NodeDevices(_backend(tmp_path)))
    restarted.devices.set_modes({0: GpuMode.MIG})
    reconcile_at_start(restarted, CheckpointStore(tmp_path / "data" / "checkpoint.json"), claims)
    assert [d.gpu_uuid for d in restarted.devices.backend.mps_daemons()] == [target.uuid]

    assert restarted.unprepare([ref])[ref.uid].error == ""
    backend = _backend(tmp_path)
    assert backend.mps_daemons() == []
    assert [m.uuid for m in backend.list_mig_devices(0)] == [i.uuid for i in instances]
    _parent_untouched(backend, 0)


# -- two claims, two partitions of one GPU -----------------------------------------------


def test_two_claims_on_two_partitions_of_one_gpu_each_get_their_own_daemon_concurrently(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, ClaimTable())
    refs = [
        node.table.add(
            f"c{i}",
            device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-{i}"),
            configs=(mig_mps(defaultActiveThreadPercentage=20 + i),),
        )
        for i in (0, 1)
    ]
    start = threading.Barrier(len(refs))
    in_flight: list[str] = []
    node.preparer.on_step = lambda step, uid: in_flight.append(f"{step}:{uid}")

    def prepare(ref: ClaimRef) -> str:
        start.wait(10)
        return node.preparer.prepare([ref])[ref.uid].error

    with ThreadPoolExecutor(len(refs)) as pool:
        assert list(pool.map(prepare, refs)) == ["", ""]
    assert {s.split(":")[1] for s in in_flight if s.startswith("after-mps-started")} == {
        r.uid for r in refs
    }

    by_key = {d.gpu_uuid: d for d in node.backend.mps_daemons()}
    assert len(by_key) == 2 and {d.gpu_index for d in by_key.values()} == {DYNAMIC_GPU}
    assert len({d.pipe_dir for d in by_key.values()}) == 2
    records = node.preparer.load_checkpoint().claims
    for i, ref in enumerate(refs):
        share = records[ref.uid].created.mps_share
        assert share is not None and share.mig
        (key,) = share.gpu_uuids
        started = node.backend.mig_mps_daemon(key)
        assert started is not None and started.active_thread_percentage == 20 + i
        assert _env(node.preparer, ref.uid)["CUDA_MPS_PIPE_DIRECTORY"] == by_key[key].pipe_dir
    _parent_untouched(node.backend, DYNAMIC_GPU)

    # One claim ends: its daemon and partition go, the other claim's stay.
    assert node.preparer.unprepare([refs[0]])[refs[0].uid].error == ""
    (left,) = node.backend.mps_daemons()
    assert [left.gpu_uuid] == records[refs[1].uid].created.mps_share.gpu_uuids  # type: ignore[union-attr]
    assert [m.uuid for m in node.backend.list_mig_devices(DYNAMIC_GPU)] == [left.gpu_uuid]
    assert node.preparer.unprepare([refs[1]])[refs[1].uid].error == ""
    assert node.backend.mps_daemons() == []


# -- restarts and crashes ----------------------------------------------------------------


def _restart(node: Node) -> Any:
    node.restart()
    with node.lock:
        return reconcile_at_start(node.preparer, node.store, node.table)


def test_a_restart_keeps_the_daemon_a_prepared_claim_uses(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    ref = node.table.add("kept", device(f"gpu-{DYNAMIC_GPU}-mig-2g20gb-0"), configs=(mig_mps(),))
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    (daemon,) = node.backend.mps_daemons()
    starts = node.backend.mps_starts(DYNAMIC_GPU)
    # A leftover daemon of a claim that is gone is stopped; the claim's own is kept.
    (profile,) = [p for p in node.backend.mig_profiles(DYNAMIC_GPU) if p.name == "1g.10gb"]
    stray = node.backend.create_mig_device(DYNAMIC_GPU, profile.profile_id, profile.placements[-1])

    report = _restart(node)

    assert report.kept == ["ns/kept"]
    assert node.backend.mps_daemons() == [daemon]
    assert node.backend.mps_starts(DYNAMIC_GPU) == starts  # adopted, not started again
    assert stray.uuid not in {m.uuid for m in node.backend.list_mig_devices(DYNAMIC_GPU)}
    assert node.preparer.prepare([ref])[ref.uid].error == ""  # the kubelet asks again
    assert node.backend.mps_daemons() == [daemon]
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert node.backend.mps_daemons() == [] and node.backend.list_mig_devices(DYNAMIC_GPU) == []


def test_a_lost_record_is_rebuilt_with_its_daemon_from_the_cdi_spec(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    ref = node.table.add("lost", device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-3"), configs=(mig_mps(),))
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    (daemon,) = node.backend.mps_daemons()
    node.store.record_path(ref.uid).write_text("{")

    report = _restart(node)

    assert report.rebuilt == ["ns/lost"] and report.rebuilt_mps == 1
    assert node.backend.mps_daemons() == [daemon]
    share = node.preparer.load_checkpoint().claims[ref.uid].created.mps_share
    assert share is not None and share.mig and share.gpu_uuids == [daemon.gpu_uuid]
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert node.backend.mps_daemons() == [] and node.backend.list_mig_devices(DYNAMIC_GPU) == []


def _killed(node: Node, call: str, ref: ClaimRef, step: str) -> None:
    """Runs ``prepare`` or ``unprepare`` of ``ref`` in a fresh plugin process that SIGKILLs
    itself at ``step``, as an OOM kill or a node shutdown would interrupt it."""

    def child() -> None:
        preparer = ClaimPreparerImpl(
            node_name=NODE,
            claims=node.table,
            devices=NodeDevices(
                SimulatedBackend.from_topology(
                    "hgx-h100-8", NODE, state_path=node.data_dir / "simulated-gpus.json"
                ),
                dynamic_mig={DYNAMIC_GPU},
            ),
            store=CheckpointStore(node.data_dir / "checkpoint.json", node.root / "boot_id"),
            lock=PrepareLock(node.data_dir / "prepare.lock", timeout=20),
            cdi_dir=node.root / "cdi",
            crash_at=step,
        )
        getattr(preparer, call)([ref])
        os._exit(3)  # the step was never reached

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == -signal.SIGKILL, f"not killed at {step}"


@pytest.mark.parametrize(
    "step",
    ["after-prepare-started", "after-devices-created", "after-mps-started", "after-cdi-written"],
)
def test_sigkill_during_prepare_leaves_nothing_after_the_restart(tmp_path: Path, step: str) -> None:
    node = Node(tmp_path, ClaimTable())
    ref = node.table.add(
        "half",
        device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-2"),
        configs=(mig_mps(defaultActiveThreadPercentage=5),),
    )
    _killed(node, "prepare", ref, step)
    node.restart()
    assert node.store.get(ref.uid) is not None  # PrepareStarted, as the kill left it

    report = _restart(node)

    assert report.rolled_back == ["ns/half"]
    assert node.backend.mps_daemons() == [] and node.backend.list_mig_devices(DYNAMIC_GPU) == []
    assert list((tmp_path / "cdi").glob("*.json")) == []
    _parent_untouched(node.backend, DYNAMIC_GPU)
    # The kubelet's retry prepares it from scratch.
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    assert len(node.backend.mps_daemons()) == 1


def test_sigkill_during_prepare_is_finished_by_the_kubelets_retry_alone(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    ref = node.table.add("retry", device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-5"), configs=(mig_mps(),))
    _killed(node, "prepare", ref, "after-mps-started")
    node.restart()  # no reconcile: a plugin of another version takes the call
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    (instance,) = node.backend.list_mig_devices(DYNAMIC_GPU)
    assert [d.gpu_uuid for d in node.backend.mps_daemons()] == [instance.uuid]
    record = node.store.get(ref.uid)
    assert record is not None and record.state == ClaimState.PREPARED


def test_sigkill_between_stopping_the_daemon_and_destroying_the_partition(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, ClaimTable())
    ref = node.table.add("going", device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-6"), configs=(mig_mps(),))
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    _killed(node, "unprepare", ref, "undo-mps-stopped")
    node.restart()
    assert node.backend.mps_daemons() == []
    assert len(node.backend.list_mig_devices(DYNAMIC_GPU)) == 1

    report = _restart(node)

    # The record still says Prepared: kept (the pod may still run) until the kubelet's
    # retried unprepare finishes the job.
    assert report.kept == ["ns/going"]
    assert len(node.backend.list_mig_devices(DYNAMIC_GPU)) == 1
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert node.backend.list_mig_devices(DYNAMIC_GPU) == [] and node.store.get(ref.uid) is None
