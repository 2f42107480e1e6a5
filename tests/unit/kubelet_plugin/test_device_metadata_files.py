"""Device metadata files (KEP-5304) through prepare and unprepare on the simulated H100 node:
what each kind of device's file says, how the claim's CDI spec hands each request its own
file, and that the files come and go with the claim's record: removed by unprepare, by a
failed prepare, and by start-up after a SIGKILL anywhere in prepare."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.claim_results import parse_consumed_capacity
from flexgpu.driver.device_metadata import decode_metadata
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimState
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.startup_reconcile import ReconcileReport, reconcile_at_start
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef, PreparedDevice
from tests.unit.kubelet_plugin.prepare_support import (
    API,
    DRIVER,
    DYNAMIC_GPU,
    NODE,
    SHARED_GPU,
    ClaimTable,
    Node,
    device,
    mig_mps,
    time_slicing,
)

CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
FILE = "gpu.flexgpu.dev-metadata.json"
STATIC_GPU = 6  # in MIG mode with instances made before any claim (static_instance)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, ClaimTable())


def _prepared(node: Node, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
    (result,) = node.preparer.prepare([ref]).values()
    assert result.error == ""
    return result.devices


def _folder(node: Node, ref: ClaimRef) -> Path:
    return node.data_dir / "dra-device-metadata" / ref.uid


def _file(node: Node, ref: ClaimRef, request: str = "gpu") -> dict[str, Any]:
    """The v1beta1 object of a request's file (the first in the stream)."""
    objects = decode_metadata((_folder(node, ref) / request / "metadata.json").read_bytes())
    assert [o["apiVersion"] for o in objects] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    return objects[0]


def _devices(node: Node, ref: ClaimRef, request: str = "gpu") -> list[dict[str, Any]]:
    (entry,) = _file(node, ref, request)["requests"]
    devices: list[dict[str, Any]] = entry["devices"]
    return devices


def _attrs(node: Node, ref: ClaimRef, request: str = "gpu") -> dict[str, Any]:
    (only,) = _devices(node, ref, request)
    attributes: dict[str, Any] = only["attributes"]
    return attributes


def _published(node: Node, name: str) -> dict[str, Any]:
    (published,) = [d for d in node.devices.slice_devices() if d["name"] == name]
    attributes: dict[str, Any] = published["attributes"]
    return attributes


def _spec(node: Node, ref: ClaimRef) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(node.preparer.spec_path(ref.uid).read_text())
    return spec


def _nothing_left(node: Node, ref: ClaimRef) -> None:
    assert node.store.get(ref.uid) is None
    assert not _folder(node, ref).exists()
    assert not node.preparer.spec_path(ref.uid).exists()


def _restart(node: Node) -> ReconcileReport:
    node.restart()
    with node.lock:
        return reconcile_at_start(node.preparer, node.store, node.table)


# -- what each kind of device's file says ----------------------------------------------


def test_a_whole_gpu_file_has_the_claim_the_request_and_its_published_attributes(
    node: Node,
) -> None:
    ref = node.table.add("whole", device("gpu-0"))
    _prepared(node, ref)
    obj = _file(node, ref)
    assert obj["kind"] == "DeviceMetadata"
    assert obj["metadata"] == {"name": "whole", "namespace": "ns", "uid": ref.uid, "generation": 1}
    assert "podClaimName" not in obj
    (entry,) = obj["requests"]
    assert entry["name"] == "gpu"
    (dev,) = entry["devices"]
    assert (dev["driver"], dev["pool"], dev["name"]) == (DRIVER, NODE, "gpu-0")
    published = _published(node, "gpu-0")
    assert dev["attributes"] == published
    for name in ("uuid", "productName", "nvlinkDomain", "resource.kubernetes.io/pciBusID"):
        assert name in dev["attributes"]
    assert dev["attributes"]["type"] == {"string": "gpu"}


def test_an_on_demand_mig_device_has_the_uuid_of_the_instance_prepare_made(node: Node) -> None:
    name = f"gpu-{DYNAMIC_GPU}-mig-3g40gb-4"
    ref = node.table.add("mig", device(name))
    _prepared(node, ref)
    (instance,) = node.backend.list_mig_devices(DYNAMIC_GPU)
    attrs = _attrs(node, ref)
    assert attrs["uuid"] == {"string": instance.uuid}
    assert attrs["profile"] == {"string": "3g.40gb"}
    assert (attrs["placementStart"], attrs["placementSize"]) == ({"int": 4}, {"int": 4})
    parent = node.devices.gpus_by_index()[DYNAMIC_GPU]
    assert attrs["parentUUID"] == {"string": parent.uuid}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": parent.pci_bus_id}
    assert {k: v for k, v in attrs.items() if k != "uuid"} == _published(node, name)


def static_instance(node: Node) -> str:
    """A 1g.10gb instance on GPU 6 (MIG mode on) made before any claim; its device name."""
    node.backend.set_mig_mode(STATIC_GPU, True)
    (profile,) = [p for p in node.backend.mig_profiles(STATIC_GPU) if p.name == "1g.10gb"]
    node.backend.create_mig_device(STATIC_GPU, profile.profile_id, profile.placements[0])
    node.devices.refresh()
    (name,) = [
        d["name"]
        for d in node.devices.slice_devices()
        if d["name"].startswith(f"gpu-{STATIC_GPU}-mig-")
    ]
    return name


def test_a_static_mig_device_has_what_it_is_published_with(node: Node) -> None:
    name = static_instance(node)
    ref = node.table.add("static", device(name))
    _prepared(node, ref)
    attrs = _attrs(node, ref)
    assert attrs == _published(node, name)
    assert attrs["type"] == {"string": "mig"} and attrs["uuid"]["string"].startswith("MIG-")


def test_a_fraction_has_its_share_id_and_what_it_was_granted(node: Node) -> None:
    granted = parse_consumed_capacity({"memory": "16Gi", "compute": "30"})
    ref = node.table.add(
        "frac", device(f"gpu-{SHARED_GPU}", share_id="s-1", consumed_capacity=granted)
    )
    _prepared(node, ref)
    (dev,) = _devices(node, ref)
    attrs = dev["attributes"]
    assert dev["name"] == f"gpu-{SHARED_GPU}"
    assert attrs["type"] == {"string": "shared"}
    assert attrs["shareID"] == {"string": "s-1"}
    assert attrs["consumedMemory"] == {"int": 16 * 1024**3}
    assert attrs["consumedCompute"] == {"int": 30}
    assert "tenant" not in attrs


def test_two_fractions_of_one_claim_are_both_in_their_requests_file(node: Node) -> None:
    memory = parse_consumed_capacity({"memory": "8Gi"})
    ref = node.table.add(
        "two",
        device(f"gpu-{SHARED_GPU}", share_id="s1", consumed_capacity=memory),
        device(f"gpu-{SHARED_GPU}", share_id="s2", consumed_capacity=memory),
    )
    devices = _prepared(node, ref)
    assert [d["attributes"]["shareID"]["string"] for d in _devices(node, ref)] == ["s1", "s2"]
    # One mount for the request, handed with its first device.
    assert [len(d.cdi_device_ids) for d in devices] == [2, 1]


@pytest.mark.parametrize(
    "config",
    [
        time_slicing("Long"),
        {
            "source": "FromClaim",
            "opaque": {
                "driver": DRIVER,
                "parameters": {
                    "apiVersion": API,
                    "kind": "GpuConfig",
                    "sharing": {
                        "strategy": "MPS",
                        "mpsConfig": {"defaultActiveThreadPercentage": 40},
                    },
                },
            },
        },
    ],
    ids=["time-sliced", "mps"],
)
def test_a_shared_whole_gpu_has_its_published_attributes(
    node: Node, config: dict[str, Any]
) -> None:
    ref = node.table.add("shared", device("gpu-3"), configs=(config,))
    _prepared(node, ref)
    assert _attrs(node, ref) == _published(node, "gpu-3")


def test_mps_on_a_mig_device_writes_its_file_too(node: Node) -> None:
    ref = node.table.add(
        "migmps",
        device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-0"),
        configs=(mig_mps(defaultActiveThreadPercentage=25),),
    )
    _prepared(node, ref)
    (instance,) = node.backend.list_mig_devices(DYNAMIC_GPU)
    assert _attrs(node, ref)["uuid"] == {"string": instance.uuid}


def test_an_admin_access_claim_sees_a_device_another_claim_holds(node: Node) -> None:
    held = node.table.add("held", device("gpu-4"))
    _prepared(node, held)
    admin = node.table.add(
        "monitor",
        device("gpu-4", "gpus", admin_access=True),
        device("gpu-5", "gpus", admin_access=True),
    )
    _prepared(node, admin)
    names = [d["name"] for d in _devices(node, admin, "gpus")]
    assert names == ["gpu-4", "gpu-5"]
    assert _attrs(node, held) == _devices(node, admin, "gpus")[0]["attributes"]


def test_a_claim_from_a_template_is_read_under_the_pods_name_for_it(node: Node) -> None:
    ref = node.table.add("pod-1-gpu-x7k2p", device("gpu-0"), pod_claim_name="gpu")
    _prepared(node, ref)
    assert _file(node, ref)["podClaimName"] == "gpu"
    (mount,) = [
        m for d in _spec(node, ref)["devices"] for m in d["containerEdits"].get("mounts", [])
    ]
    assert mount["containerPath"] == f"{CONTAINER_DIR}/resourceclaimtemplates/gpu/gpu/{FILE}"


def test_a_subrequest_is_named_in_the_file_of_its_request(node: Node) -> None:
    ref = node.table.add("first", device("gpu-0", "gpu/h100"))
    _prepared(node, ref)
    assert _file(node, ref)["requests"][0]["name"] == "gpu/h100"


# -- one file per request, read-only, handed only with its request ------------------------


def test_the_spec_mounts_exactly_each_requests_file_read_only(node: Node) -> None:
    ref = node.table.add("pair", device("gpu-0", "a"), device("gpu-3", "b"), device("gpu-4", "b"))
    prepared = _prepared(node, ref)
    spec = _spec(node, ref)
    by_id = {f"gpu.flexgpu.dev/claim={d['name']}": d["containerEdits"] for d in spec["devices"]}
    folder = _folder(node, ref)
    assert sorted(p.name for p in folder.iterdir()) == ["a", "b"]
    for request in ("a", "b"):
        # What the kubelet hands a container that names this request: the CDI devices of
        # the devices that serve it.
        ids = [i for d in prepared if request in d.request_names for i in d.cdi_device_ids]
        mounts = [m for i in ids for m in by_id[i].get("mounts", [])]
        assert mounts == [
            {
                "hostPath": str(folder / request / "metadata.json"),
                "containerPath": f"{CONTAINER_DIR}/resourceclaims/pair/{request}/{FILE}",
                "options": ["ro", "bind", "nosuid", "nodev", "noexec"],
            }
        ]
        assert [d["name"] for d in _devices(node, ref, request)] == (
            ["gpu-0"] if request == "a" else ["gpu-3", "gpu-4"]
        )
    # Every CDI device the kubelet is told of is in the spec, and every one in the spec is told.
    assert sorted(by_id) == sorted(i for d in prepared for i in d.cdi_device_ids)


def test_a_device_serving_two_requests_carries_no_other_requests_file_when_it_can(
    node: Node,
) -> None:
    ref = node.table.add(
        "overlap",
        device("gpu-0", "a"),
        device("gpu-0", "b", admin_access=True),
        device("gpu-3", "b", admin_access=True),
    )
    prepared = {d.device_name: d for d in _prepared(node, ref)}
    assert prepared["gpu-0"].request_names == ("a", "b")
    assert prepared["gpu-0"].cdi_device_ids[1:] == (f"gpu.flexgpu.dev/claim={ref.uid}_metadata_a",)
    assert prepared["gpu-3"].cdi_device_ids[1:] == (f"gpu.flexgpu.dev/claim={ref.uid}_metadata_b",)


def test_files_are_readable_by_any_user_of_the_container(node: Node) -> None:
    ref = node.table.add("perm", device("gpu-0"))
    _prepared(node, ref)
    mode = (_folder(node, ref) / "gpu" / "metadata.json").stat().st_mode
    assert mode & 0o777 == 0o644


# -- lifecycle: with the record, never without it ---------------------------------------


def test_unprepare_removes_the_files_with_the_spec(node: Node) -> None:
    ref = node.table.add("gone", device("gpu-0"), device("gpu-3", "other"))
    _prepared(node, ref)
    record = node.store.get(ref.uid)
    assert record is not None and record.created.metadata_dir == str(_folder(node, ref))
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    _nothing_left(node, ref)
    assert list((node.data_dir / "dra-device-metadata").iterdir()) == []


def test_a_prepare_that_fails_after_writing_them_removes_them(node: Node) -> None:
    ref = node.table.add("fails", device("gpu-0"))

    def fail(step: str, uid: str) -> None:
        if step == "after-metadata-written":
            assert (_folder(node, ref) / "gpu" / "metadata.json").exists()
            raise OSError("disk gone")

    node.preparer.on_step = fail
    (result,) = node.preparer.prepare([ref]).values()
    assert "disk gone" in result.error
    _nothing_left(node, ref)


def test_a_prepared_claims_files_survive_a_restart_and_orphans_do_not(node: Node) -> None:
    ref = node.table.add("kept", device("gpu-0"))
    _prepared(node, ref)
    before = (_folder(node, ref) / "gpu" / "metadata.json").read_bytes()
    orphan = node.data_dir / "dra-device-metadata" / "uid-nobody" / "gpu"
    orphan.mkdir(parents=True)
    (orphan / "metadata.json").write_text("{}")

    report = _restart(node)

    assert report.orphan_metadata_removed == ["uid-nobody"]
    assert (_folder(node, ref) / "gpu" / "metadata.json").read_bytes() == before
    assert not orphan.parent.exists()


def test_a_reboot_drops_them_with_the_record(node: Node) -> None:
    ref = node.table.add("rebooted", device("gpu-0"))
    _prepared(node, ref)
    node.preparer.spec_path(ref.uid).unlink()  # /var/run is a tmpfs; the data dir is not
    node.restart(boot_id="8a2d4e6f-1b3c-4d5e-8f9a-0b1c2d3e4f5a")
    with node.lock:
        reconcile_at_start(node.preparer, node.store, node.table)
    _nothing_left(node, ref)


def test_a_lost_record_is_rebuilt_owning_them_and_unprepare_removes_them(node: Node) -> None:
    ref = node.table.add("lost", device("gpu-0"))
    devices = _prepared(node, ref)
    node.store.record_path(ref.uid).write_bytes(b"")  # torn

    report = _restart(node)

    assert report.rebuilt == ["ns/lost"]
    record = node.store.get(ref.uid)
    assert record is not None and record.created.metadata_dir == str(_folder(node, ref))
    assert node.preparer.prepare([ref])[ref.uid].devices == devices
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    _nothing_left(node, ref)


def test_a_spec_of_a_release_without_metadata_rebuilds_without_it(node: Node) -> None:
    ref = node.table.add("older", device("gpu-0"))
    _prepared(node, ref)
    spec = _spec(node, ref)
    spec["devices"] = [d for d in spec["devices"] if "_metadata_" not in d["name"]]
    node.preparer.spec_path(ref.uid).write_text(json.dumps(spec))
    node.store.record_path(ref.uid).write_bytes(b"")

    report = _restart(node)

    assert report.rebuilt == ["ns/older"]
    (result,) = node.preparer.prepare([ref]).values()
    # Nothing the spec cannot resolve is handed to the kubelet; the folder is an orphan.
    assert [d.cdi_device_ids for d in result.devices] == [(f"{DRIVER}/claim={ref.uid}-gpu-0",)]
    assert report.orphan_metadata_removed == [ref.uid]
    record = node.store.get(ref.uid)
    assert record is not None and record.created.metadata_dir is None


def _killed(node: Node, call: str, ref: ClaimRef, step: str) -> None:
    """``prepare`` or ``unprepare`` of ``ref`` in a fresh plugin process that SIGKILLs itself
    at ``step``, as an OOM kill or a node shutdown would interrupt it."""

    def child() -> None:
        preparer = ClaimPreparerImpl(
            node_name=NODE,
            claims=node.table,
            devices=NodeDevices(
                SimulatedBackend.from_topology(
                    "hgx-h100-8", NODE, state_path=node.data_dir / "simulated-gpus.json"
                ),
                shared={SHARED_GPU},
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
    "step", ["after-mps-started", "after-metadata-written", "after-cdi-written"]
)
def test_sigkill_around_writing_them_leaves_nothing_after_start_up(node: Node, step: str) -> None:
    ref = node.table.add("half", device(f"gpu-{DYNAMIC_GPU}-mig-1g10gb-2"), device("gpu-0", "b"))
    _killed(node, "prepare", ref, step)
    node.restart()
    record = node.store.get(ref.uid)
    assert record is not None and record.state == ClaimState.PREPARE_STARTED
    assert record.created.metadata_dir == str(_folder(node, ref))  # recorded before writing
    if step != "after-mps-started":
        assert sorted(p.name for p in _folder(node, ref).iterdir()) == ["b", "gpu"]

    report = _restart(node)

    assert report.rolled_back == ["ns/half"]
    _nothing_left(node, ref)
    assert list((node.data_dir / "dra-device-metadata").glob("*")) == []
    # The kubelet's retry writes them afresh.
    _prepared(node, ref)
    assert _attrs(node, ref, "b")["uuid"] == _published(node, "gpu-0")["uuid"]


def test_sigkill_in_unprepare_keeps_them_for_the_next_unprepare(node: Node) -> None:
    ref = node.table.add("leaving", device("gpu-0"))
    _prepared(node, ref)
    _killed(node, "unprepare", ref, "unprepare-locked")
    report = _restart(node)
    assert report.kept == ["ns/leaving"] and (_folder(node, ref) / "gpu").is_dir()
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    _nothing_left(node, ref)
