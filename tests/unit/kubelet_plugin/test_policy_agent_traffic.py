"""The node policy agent works from watched copies: after its first LIST of policies and of
its Node, re-evaluating (a poke, or an unprepare while a change waits) sends nothing to the
API server unless a status changes, and a policy or label change arrives through the watch."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.agents.policy_agent import PLURAL, VERSION, PolicyAgent
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import END, FakeKubeApi

NODE = "node-a"
POLICIES = f"/apis/{CRD_GROUP}/{VERSION}/{PLURAL}"
NODES = "/api/v1/nodes"


def policy(version: str, layout: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": f"{CRD_GROUP}/{VERSION}",
        "kind": "GpuNodePolicy",
        "metadata": {"name": "split", "generation": 1, "resourceVersion": version},
        "spec": {
            "nodeSelector": {"matchLabels": {"flexgpu.dev/pool": "p"}},
            "gpus": [{"selector": {"indices": [0]}, "mode": "MIG", "migLayout": layout}],
        },
    }


def node(version: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": NODE, "resourceVersion": version, "labels": labels}}


@pytest.fixture
def api() -> FakeKubeApi:
    fake = FakeKubeApi()
    fake.lists[POLICIES] = [policy("10", {"3g.40gb": 2})]
    fake.lists[NODES] = [node("20", **{"flexgpu.dev/pool": "p"})]
    fake.put_object(f"{POLICIES}/split", policy("10", {"3g.40gb": 2}))
    return fake


@pytest.fixture
def parts(tmp_path: Path) -> tuple[NodeDevices, ClaimPreparerImpl]:
    devices = NodeDevices(
        SimulatedBackend.from_topology("hgx-h100-8", NODE, state_path=tmp_path / "gpus.json")
    )
    preparer = ClaimPreparerImpl(
        node_name=NODE,
        claims=None,  # type: ignore[arg-type]  # unprepare never reads claims
        devices=devices,
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )
    return devices, preparer


@pytest.fixture
def agent(
    api: FakeKubeApi, parts: tuple[NodeDevices, ClaimPreparerImpl], tmp_path: Path
) -> Iterator[PolicyAgent]:
    devices, preparer = parts
    running = PolicyAgent(
        api,  # type: ignore[arg-type]
        NODE,
        devices=devices,
        preparer=preparer,
        # Another instance on the preparer's lock files: they exclude each other by flock.
        lock=PrepareLock(tmp_path / "data" / "lock"),
        republish=lambda: None,
    )
    preparer.on_unprepared = running.claim_unprepared
    running.start()
    yield running
    running.stop()


def watches(api: FakeKubeApi) -> dict[str, queue.Queue[Any]]:
    """The two watch streams, by the path they watch, once both are open."""
    opened = [api.watches.get(timeout=10) for _ in range(2)]
    return {api.watched_paths[id(q)]: q for q in opened}


def status_patches(api: FakeKubeApi) -> int:
    return api.sent.count(("PATCH", f"{POLICIES}/split/status"))


def test_re_evaluating_sends_no_request(
    api: FakeKubeApi, agent: PolicyAgent, parts: tuple[NodeDevices, ClaimPreparerImpl]
) -> None:
    devices, preparer = parts
    streams = watches(api)
    wait_for(lambda: devices.mode(0) == "MIG" and status_patches(api) == 1, what="policy applied")
    # The watch brings our own status write back.
    streams[POLICIES].put(("MODIFIED", api.objects[f"{POLICIES}/split"]))
    sent = len(api.sent)
    for i in range(20):
        passes = agent.passes
        preparer.unprepare([ClaimRef("ns", f"c{i}", f"u{i}")])
        agent.poke()
        wait_for(lambda p=passes: agent.passes > p, what="a pass after the poke")
    assert api.sent[sent:] == []
    assert [v for v, _ in api.sent].count("GET") == 2  # the two first LISTs, nothing since


def test_changes_arrive_through_the_watch(
    api: FakeKubeApi, agent: PolicyAgent, parts: tuple[NodeDevices, ClaimPreparerImpl]
) -> None:
    devices, _ = parts
    streams = watches(api)
    wait_for(lambda: devices.mode(0) == "MIG", what="policy applied")
    streams[NODES].put(("MODIFIED", node("21")))  # label removed: the policy no longer selects
    wait_for(lambda: devices.mode(0) == "Whole", what="GPU 0 back to the flags' mode")
    assert [v for v, _ in api.sent].count("GET") == 2


def test_node_status_updates_do_not_wake_the_agent(
    api: FakeKubeApi, agent: PolicyAgent, parts: tuple[NodeDevices, ClaimPreparerImpl]
) -> None:
    devices, _ = parts
    streams = watches(api)
    wait_for(lambda: devices.mode(0) == "MIG", what="policy applied")
    pokes: list[str] = []
    agent.poke = lambda: pokes.append("poke")  # type: ignore[method-assign]
    heartbeat = node("22", **{"flexgpu.dev/pool": "p"})
    heartbeat["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    streams[NODES].put(("MODIFIED", heartbeat))
    relabelled = node("23", **{"flexgpu.dev/pool": "p", "team": "a"})
    streams[NODES].put(("MODIFIED", relabelled))
    streams[NODES].put(END)  # the server ends the watch; the copy watches again
    # The new watch opens only after both events were handled.
    api.watches.get(timeout=10)
    assert agent.node.get(NODE) == relabelled
    assert pokes == ["poke"]  # for the label change, not for the status update
