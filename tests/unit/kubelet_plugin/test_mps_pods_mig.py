"""MIG device MPS daemons as pods: the pod sees only the claim's MIG devices, the parent GPU's
compute mode is left alone, the claim's limits reach the daemon through its control pipe, and
a pod that ended is started again as it was while its devices exist (a leftover whose devices
are gone is deleted instead). The API server is a small in-memory one that runs a pod by
making its control pipe appear."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.gpu_model import ComputeMode, MigDevice
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.agents.mps_pods import (
    CONTROL,
    GPU_INDEX_LABEL,
    GPU_UUID_ANNOTATION,
    MpsDaemonPods,
    pod_name,
)
from flexgpu.kubelet_plugin.api.kube_api import ApiError

NAMESPACE = "flexgpu"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"


class PodApi:
    """Pods by name; a created pod runs at once (its control pipe appears)."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.created: list[dict[str, Any]] = []

    def get(self, path: str, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def request(
        self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: Any = None
    ) -> dict[str, Any]:
        if path == "/api/v1/nodes":
            return {"items": [{"metadata": {"name": "n", "uid": "node-uid"}}]}
        if method == "GET" and path == PODS:
            return {"items": copy.deepcopy(list(self.pods.values()))}
        if method == "POST" and path == PODS:
            pod = copy.deepcopy(body)
            pod["status"] = {"phase": "Running"}
            env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
            os.mkfifo(Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "control")
            self.pods[pod["metadata"]["name"]] = pod
            self.created.append(copy.deepcopy(body))
            return copy.deepcopy(pod)
        name = path.rsplit("/", 1)[-1]
        if name not in self.pods:
            raise ApiError(404, "NotFound", f"{name} not found")
        if method == "DELETE":
            return self.pods.pop(name)
        return copy.deepcopy(self.pods[name])

    def end(self, name: str) -> None:
        self.pods[name]["status"] = {
            "phase": "Failed",
            "containerStatuses": [{"state": {"terminated": {"exitCode": 1, "reason": "Error"}}}],
        }


class Control:
    """Stands in for the driver root's control program run as a client."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str, dict[str, str]]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, kw["input"], kw["env"]))
        return subprocess.CompletedProcess(argv, 0, "", "")


@contextlib.contextmanager
def _no_lock(index: int) -> Iterator[None]:
    yield


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend.from_topology("hgx-h100-8", "n", state_path=tmp_path / "s.json")


def _instances(backend: SimulatedBackend, count: int) -> list[MigDevice]:
    backend.set_mig_mode(0, True)
    (profile,) = [p for p in backend.mig_profiles(0) if p.name == "1g.10gb"]
    return [backend.create_mig_device(0, profile.profile_id, p) for p in profile.placements[:count]]


def _pods(tmp_path: Path, backend: SimulatedBackend, api: PodApi, run: Control) -> MpsDaemonPods:
    return MpsDaemonPods(
        api,  # type: ignore[arg-type]
        backend,
        node_name="n",
        namespace=NAMESPACE,
        image="img",
        mps_root=tmp_path / "mps",
        driver_root=tmp_path / "driver",
        ready_timeout_s=2,
        run=run,
    )


def test_a_mig_pod_sees_the_claims_devices_and_gets_its_limits(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    api, run = PodApi(), Control()
    pods = _pods(tmp_path, backend, api, run)
    uuids = tuple(sorted(m.uuid or "" for m in _instances(backend, 2)))
    spec = MigMpsDaemonSpec(0, uuids, active_thread_percentage=40, pinned_memory_mib=(None, 2048))

    daemon = pods.start_mig(spec)

    (pod,) = api.created
    assert pod["metadata"]["name"] == pod_name(uuids[0])
    assert pod["metadata"]["labels"][GPU_INDEX_LABEL] == "0"
    assert pod["metadata"]["annotations"][GPU_UUID_ANNOTATION] == uuids[0]
    container = pod["spec"]["containers"][0]
    # The shape the chart's admission policy allows: the control program in the foreground.
    assert container["command"] == [str(tmp_path / "driver" / CONTROL), "-f"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
    assert backend.get_compute_mode(0) == ComputeMode.DEFAULT
    assert [(argv, text) for argv, text, _ in run.calls] == [
        ([str(tmp_path / "driver" / CONTROL)], "set_default_active_thread_percentage 40\n"),
        (
            [str(tmp_path / "driver" / CONTROL)],
            f"set_default_device_pinned_mem_limit {uuids[1]} 2048M\n",
        ),
    ]
    assert run.calls[0][2]["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
    assert pods.running() == [daemon]

    pods.stop_mig(0, uuids[0])
    assert api.pods == {} and backend.get_compute_mode(0) == ComputeMode.DEFAULT


def test_an_ended_mig_pod_is_started_again_as_it_was(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    api, run = PodApi(), Control()
    pods = _pods(tmp_path, backend, api, run)
    (instance,) = _instances(backend, 1)
    assert instance.uuid is not None
    spec = MigMpsDaemonSpec(0, (instance.uuid,), active_thread_percentage=10)
    pods.start_mig(spec)
    api.end(pod_name(instance.uuid))
    assert pods.running() == []

    assert pods.restart_ended(lambda: {0}, _no_lock) == [0]

    first, again = api.created
    assert again["spec"] == first["spec"] and again["metadata"] == first["metadata"]
    assert [text for _, text, _ in run.calls] == ["set_default_active_thread_percentage 10\n"] * 2
    # Never taken for the parent GPU's own daemon: that would set exclusive-process mode.
    assert backend.get_compute_mode(0) == ComputeMode.DEFAULT
    assert json.loads(again["metadata"]["annotations"]["gpu.flexgpu.dev/mig-mps"])["devices"] == [
        instance.uuid
    ]


def test_an_ended_mig_pod_whose_devices_are_gone_is_deleted(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    api, run = PodApi(), Control()
    pods = _pods(tmp_path, backend, api, run)
    (instance,) = _instances(backend, 1)
    assert instance.uuid is not None
    pods.start_mig(MigMpsDaemonSpec(0, (instance.uuid,)))
    api.end(pod_name(instance.uuid))
    backend.destroy_mig_device(0, instance.gpu_instance_id)

    assert pods.restart_ended(lambda: {0}, _no_lock) == []
    assert api.pods == {} and len(api.created) == 1


def test_a_gpu_in_mig_mode_never_gets_its_own_daemon_started_again(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    """GPU 0 is in use for a MIG device daemon; an ended pod of GPU 0's own daemon, left from
    before MIG mode, is not started again (it would take the parent exclusive)."""
    api, run = PodApi(), Control()
    pods = _pods(tmp_path, backend, api, run)
    pods.start(0)
    api.end(pod_name(backend.list_gpus()[0].uuid))
    backend.set_compute_mode(0, ComputeMode.DEFAULT)
    (instance,) = _instances(backend, 1)
    assert instance.uuid is not None
    pods.start_mig(MigMpsDaemonSpec(0, (instance.uuid,)))

    assert pods.restart_ended(lambda: {0}, _no_lock) == []
    assert backend.get_compute_mode(0) == ComputeMode.DEFAULT
    assert len(api.created) == 2


def test_daemon_pods_are_owned_by_the_plugins_daemonset(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    """With its own pod named, the plugin gives the daemons that pod's controller (the
    chart's DaemonSet) as owner, not as their controller: helm uninstall removes them, the
    DaemonSet never adopts them. Without it (a harness) the Node owns them."""
    api, run = PodApi(), Control()
    daemonset = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds-uid"}
    api.pods["plugin-abc"] = {
        "metadata": {
            "name": "plugin-abc",
            "ownerReferences": [{**daemonset, "controller": True, "blockOwnerDeletion": True}],
        }
    }
    pods = MpsDaemonPods(
        api,  # type: ignore[arg-type]
        backend,
        node_name="n",
        namespace=NAMESPACE,
        image="img",
        mps_root=tmp_path / "mps",
        driver_root=tmp_path / "driver",
        ready_timeout_s=2,
        run=run,
        owner_pod="plugin-abc",
    )
    pods.start(0)
    assert api.created[0]["metadata"]["ownerReferences"] == [daemonset]
    spec = api.created[0]["spec"]
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False

    harness = _pods(tmp_path / "other", backend, PodApi(), Control())
    owner = harness._owner_of()
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", "n", "node-uid")


def test_daemon_pods_started_after_a_driver_change_link_the_new_drivers_libraries(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    api, run = PodApi(), Control()
    pods = _pods(tmp_path, backend, api, run)
    lib = "usr/lib/x86_64-linux-gnu/libcuda.so.590.44.01"
    pods.follow_driver({"mounts": [{"hostPath": f"/host/{lib}", "containerPath": f"/{lib}"}]})
    uuids = tuple(sorted(m.uuid or "" for m in _instances(backend, 1)))
    pods.start_mig(MigMpsDaemonSpec(0, uuids, active_thread_percentage=40))
    link = tmp_path / "mps" / "lib" / "libcuda.so.590.44.01"
    assert os.readlink(link) == str(tmp_path / "driver" / lib)
