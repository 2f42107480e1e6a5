"""NVIDIA's quickstart MIG flow on flexgpu: the GPUs are partitioned beforehand as its
``mig-parted apply -c half-balanced`` does (GPUs 0-3: 1g.5gb x2, 2g.10gb, 3g.20gb), no
GpuNodePolicy and no flag gives them a mode, and gpu-test4 (changed only in names) runs on
those MIG devices: every container gets one of the instances made beforehand, and they are
all still there, unchanged, after the pods are gone and the plugin restarted."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.sim_state import load_state
from tests.conftest import wait_for
from tests.integration.gpu_workloads import ensure_device_classes, granted
from tools.cluster import ControlPlane
from tools.cluster.binaries import helm_tools_dir
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent / "nvidia_quickstart"
TOPOLOGY = HERE / "a100-40gb-8-half-balanced.yaml"
NODE = "quickstart-adopt"
# Where each instance of the half-balanced layout sits (profile, first memory slice): the one
# arrangement of 3g.20gb + 2g.10gb + 2x 1g.5gb an A100 40GB allows.
HALF_BALANCED = (("3g.20gb", 4), ("2g.10gb", 2), ("1g.5gb", 0), ("1g.5gb", 1))


def _partition(node: SimulatedGpuNode) -> dict[str, str]:
    """MIG UUID -> parent GPU UUID of the layout made on GPUs 0-3 before the plugin runs."""
    node.data_dir.mkdir(parents=True, exist_ok=True)
    backend = SimulatedBackend.from_topology(
        TOPOLOGY, NODE, state_path=node.data_dir / "simulated-gpus.json"
    )
    for index in range(4):
        profiles = {p.name: p for p in backend.mig_profiles(index)}
        for name, start in HALF_BALANCED:
            (placement,) = [p for p in profiles[name].placements if p.start == start]
            backend.create_mig_device(index, profiles[name].profile_id, placement)
    made = {str(d.uuid): d.parent_uuid for i in range(4) for d in backend.list_mig_devices(i)}
    backend.close()
    assert len(made) == 16
    return made


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[tuple[SimulatedGpuNode, dict[str, str]]]:
    ensure_device_classes(api)
    sim = SimulatedGpuNode(cluster.kubeconfig, NODE, str(TOPOLOGY))
    made = _partition(sim)
    try:
        sim.start()
        yield sim, made
    finally:
        sim.cleanup()


def _kubectl(cluster: ControlPlane, *args: str) -> None:
    subprocess.run(
        [str(helm_tools_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )


def _instances(node: SimulatedGpuNode) -> set[str]:
    """MIG UUIDs the node's (simulated) hardware holds now."""
    state = load_state(node.data_dir / "simulated-gpus.json")
    assert state is not None
    return {i.uuid for gpu in state.gpus for i in gpu.mig_instances}


def test_gpu_test4_runs_on_the_mig_devices_made_beforehand(
    cluster: ControlPlane, api: Any, node: tuple[SimulatedGpuNode, dict[str, str]]
) -> None:
    sim, made = node
    core = client.CoreV1Api(api)
    _kubectl(cluster, "apply", "-f", str(HERE / "gpu-test4.yaml"))
    try:

        def started() -> dict[str, list[str]] | None:
            found: dict[str, list[str]] = {}
            for pod in core.list_namespaced_pod("gpu-test4").items:
                folder = sim.root / "kubelet" / "pods" / f"gpu-test4_{pod.metadata.name}"
                uuids = []
                for container in pod.spec.containers:
                    path = folder / f"{container.name}.oci.json"
                    if not path.exists():
                        return None
                    env = json.loads(path.read_text())["process"]["env"]
                    (device,) = granted(dict(e.split("=", 1) for e in env))
                    uuids.append(device["uuid"])
                found[pod.metadata.name] = uuids
            return found if len(found) == 4 else None

        pods = wait_for(started, timeout_s=180, what="gpu-test4's 4 pods started")
        every = [u for uuids in pods.values() for u in uuids]
        assert sorted(every) == sorted(made), "not exactly the 16 MIG devices made beforehand"
        for uuids in pods.values():
            assert len({made[u] for u in uuids}) == 1, "a pod's devices from two GPUs"
    finally:
        _kubectl(cluster, "delete", "namespace", "gpu-test4", "--wait=true", "--timeout=180s")
    sim.stop_plugin(signal.SIGKILL)
    sim.start_plugin(timeout_s=90)
    assert set(made) <= _instances(sim), "an instance made beforehand was destroyed"
