"""The node policy agent changes a GPU's MIG layout under that GPU's resource lock, the lock
prepare holds: a prepare that has the lock when the agent wants to change the GPU finishes
first, and the agent then sees the GPU in use and leaves it alone. The interleaving is forced
with the preparer's step hook and the lock's wait hook, not left to timing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.names import CRD_GROUP
from flexgpu.kubelet_plugin.agents.policy_agent import PLURAL, VERSION, PolicyAgent
from flexgpu.kubelet_plugin.claims.prepare_lock import gpu_key
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi
from tests.unit.kubelet_plugin.prepare_support import NODE, ClaimTable, Node, device

POLICIES = f"/apis/{CRD_GROUP}/{VERSION}/{PLURAL}"
NODES = "/api/v1/nodes"
GPU = 0  # a whole GPU on the prepare_support node (not its shared or dynamic-MIG GPU)


def _mig_policy() -> dict[str, Any]:
    return {
        "apiVersion": f"{CRD_GROUP}/{VERSION}",
        "kind": "GpuNodePolicy",
        "metadata": {"name": "split", "generation": 1, "resourceVersion": "10"},
        "spec": {
            "nodeSelector": {"matchLabels": {"flexgpu.dev/pool": "p"}},
            "gpus": [{"selector": {"indices": [GPU]}, "mode": "MIG", "migLayout": {"3g.40gb": 2}}],
        },
    }


def _mig_on(node: Node) -> bool:
    (gpu,) = [g for g in node.backend.list_gpus() if g.index == GPU]
    return gpu.mig_mode is not None and gpu.mig_mode.current


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, ClaimTable())


@pytest.fixture
def api() -> FakeKubeApi:
    fake = FakeKubeApi()
    fake.lists[POLICIES] = [_mig_policy()]
    fake.lists[NODES] = [
        {"metadata": {"name": NODE, "resourceVersion": "20", "labels": {"flexgpu.dev/pool": "p"}}}
    ]
    fake.put_object(f"{POLICIES}/split", _mig_policy())
    return fake


@pytest.fixture
def agent(api: FakeKubeApi, node: Node) -> Iterator[PolicyAgent]:
    running = PolicyAgent(
        api,  # type: ignore[arg-type]
        NODE,
        devices=node.devices,
        preparer=node.preparer,
        lock=node.lock,
        republish=lambda: None,
    )
    yield running
    running.stop()


def test_a_prepare_holding_the_gpu_lock_finishes_before_the_agent_changes_the_gpu(
    node: Node, agent: PolicyAgent
) -> None:
    claim = node.table.add("whole-0", device(f"gpu-{GPU}"))
    locked, release = threading.Event(), threading.Event()
    agent_waits = threading.Event()

    def pause_in_lock(step: str, uid: str) -> None:
        # Holding gpu-0's lock, before anything about the claim is recorded.
        if step == "prepare-locked":
            locked.set()
            assert release.wait(30)

    def waiting(key: str) -> None:
        if key == gpu_key(GPU):
            agent_waits.set()

    node.preparer.on_step = pause_in_lock
    node.lock.on_wait = waiting
    with ThreadPoolExecutor(1) as pool:
        prepared = pool.submit(node.preparer.prepare, [claim])
        assert locked.wait(30), "prepare never reached its GPU lock"
        agent.start()
        # Without the lock the agent would switch MIG on under the prepare right here.
        assert agent_waits.wait(30), "the agent changed GPU 0 without waiting for its lock"
        assert not _mig_on(node)
        release.set()
        results = prepared.result(30)
    assert results[claim.uid].error == ""
    wait_for(lambda: agent.passes >= 1, what="the agent's first pass")
    # The agent saw the prepared claim under the lock: GPU 0 stays whole, kept off new claims.
    assert not _mig_on(node)
    assert node.backend.list_mig_devices(GPU) == []
    (published,) = [d for d in node.devices.slice_devices() if d["name"] == f"gpu-{GPU}"]
    assert published["taints"][0]["value"] == "reconfiguring"


def test_the_unprepare_of_the_last_user_lets_the_waiting_change_proceed(
    node: Node, agent: PolicyAgent
) -> None:
    claim = node.table.add("whole-0", device(f"gpu-{GPU}"))
    assert node.preparer.prepare([claim])[claim.uid].error == ""
    node.preparer.on_unprepared = agent.claim_unprepared
    agent.start()
    wait_for(lambda: agent.passes >= 1, what="the agent's first pass")
    assert not _mig_on(node)  # in use: the change waits
    passes = agent.passes
    assert node.preparer.unprepare([claim])[claim.uid].error == ""
    wait_for(lambda: _mig_on(node), what="GPU 0 switched to MIG after its claim went")
    assert agent.passes > passes
    assert sorted(d.profile_name for d in node.backend.list_mig_devices(GPU)) == ["3g.40gb"] * 2


def test_an_unprepare_with_nothing_waiting_costs_no_pass(node: Node, agent: PolicyAgent) -> None:
    """Once every GPU is as its policy wants it, unprepares do not wake the agent: a pass
    would find nothing to do, and the kubelet unprepares on every pod's end."""
    claim = node.table.add("whole-3", device("gpu-3"))  # a GPU the policy does not change
    node.preparer.on_unprepared = agent.claim_unprepared
    agent.start()
    wait_for(lambda: _mig_on(node), what="the policy applied to the idle GPU 0")
    wait_for(lambda: agent.passes >= 1, what="the pass that applied it")
    passes = agent.passes
    for _ in range(5):
        assert node.preparer.prepare([claim])[claim.uid].error == ""
        assert node.preparer.unprepare([claim])[claim.uid].error == ""
    agent.poke()  # a pass of its own, to be sure no earlier wake-up is still on its way
    wait_for(lambda: agent.passes == passes + 1, what="the poked pass")
    assert agent.passes == passes + 1
