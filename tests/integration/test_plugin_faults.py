"""Fault tests: the plugin killed mid-prepare converges after a restart with no leftovers;
slices deleted behind its back come back; a corrupted checkpoint does not stop it."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.gpu_workloads import (
    DRIVER,
    cdi_specs,
    checkpoint_claims,
    create_claim,
    ensure_device_classes,
    env_from_log,
    gpu_request,
    granted_claim_uid,
    make_pod,
    wait_container_output,
    wait_gone,
    wait_phase,
)
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

PRINT_ENV = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|FLEXGPU_)' | sort; echo DONE; sleep 60"


@pytest.fixture
def node(
    cluster: ControlPlane, api: Any, request: pytest.FixtureRequest
) -> Iterator[SimulatedGpuNode]:
    ensure_device_classes(api)
    crash_at = getattr(request, "param", None)
    env = dict(os.environ, FLEXGPU_FAULT_CRASH_AT=crash_at) if crash_at else None
    name = f"fault-{request.node.name.split('[')[0][-20:].replace('_', '-')}".strip("-").lower()
    sim = SimulatedGpuNode(cluster.kubeconfig, name, "l4-2-pcie", plugin_env=env)
    # The first plugin kills itself at the crash point, so wait only for the harness here.
    try:
        sim.start()
        yield sim
    finally:
        sim.cleanup()


@pytest.mark.parametrize("node", ["after-prepare-started", "after-cdi-written"], indirect=True)
def test_sigkill_mid_prepare_converges_after_restart(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    create_claim(api, namespace, "c", {"requests": [gpu_request()]})
    client.CoreV1Api(api).create_namespaced_pod(
        namespace, make_pod("p", PRINT_ENV, {"g": {"resourceClaimName": "c"}}, node.name)
    )
    assert node.plugin is not None
    first = node.plugin
    wait_for(lambda: not first.running(), timeout_s=60, what="plugin killed at the crash point")
    assert first.exit_code() == -signal.SIGKILL
    # What the crash left behind: a PrepareStarted record (and maybe the spec).
    (record,) = checkpoint_claims(node).values()
    assert record["state"] == "PrepareStarted"

    node.plugin_env = None
    node.start_plugin()
    plugin = node.plugin
    assert plugin is not None
    # Registration comes before start-up reconcile: wait for its summary.
    wait_for(lambda: "rolled back 1" in plugin.log_tail(100), what="reconcile summary")
    wait_phase(api, namespace, "p", {"Running"}, timeout_s=90)
    env = env_from_log(wait_container_output(node, namespace, "p", "DONE"))
    uid = granted_claim_uid(env)
    assert checkpoint_claims(node)[uid]["state"] == "Prepared"
    assert cdi_specs(node) == [f"{DRIVER}-claim_{uid}.json"]

    client.CoreV1Api(api).delete_namespaced_pod("p", namespace)
    wait_gone(api, namespace, "p")
    assert checkpoint_claims(node) == {}
    assert cdi_specs(node) == []


def test_deleted_slices_come_back(api: Any, node: SimulatedGpuNode) -> None:
    resource = client.ResourceV1Api(api)
    selector = f"spec.nodeName={node.name},spec.driver={DRIVER}"
    before = resource.list_resource_slice(field_selector=selector).items
    resource.delete_collection_resource_slice(field_selector=selector)
    again = wait_for(
        lambda: [
            s
            for s in resource.list_resource_slice(field_selector=selector).items
            if s.metadata.uid not in {b.metadata.uid for b in before}
        ],
        timeout_s=30,
        what="slices re-created by the plugin",
    )
    assert [d.name for d in again[0].spec.devices] == ["gpu-0", "gpu-1"]


def _node_events(api: Any, node: SimulatedGpuNode, reason: str) -> list[str]:
    events = client.CoreV1Api(api).list_namespaced_event("default").items
    return [e.message for e in events if e.reason == reason and e.involved_object.name == node.name]


def _running_claim(api: Any, namespace: str, node: SimulatedGpuNode) -> str:
    create_claim(api, namespace, "c", {"requests": [gpu_request()]})
    client.CoreV1Api(api).create_namespaced_pod(
        namespace, make_pod("p", PRINT_ENV, {"g": {"resourceClaimName": "c"}}, node.name)
    )
    wait_phase(api, namespace, "p", {"Running"})
    return granted_claim_uid(env_from_log(wait_container_output(node, namespace, "p", "DONE")))


def _pod_goes_and_nothing_is_left(api: Any, namespace: str, node: SimulatedGpuNode) -> None:
    client.CoreV1Api(api).delete_namespaced_pod("p", namespace)
    wait_gone(api, namespace, "p")
    wait_for(lambda: checkpoint_claims(node) == {}, timeout_s=30, what="the claim unprepared")
    assert cdi_specs(node) == []


def test_corrupted_checkpoint_is_rebuilt_from_cdi_and_api(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    uid = _running_claim(api, namespace, node)

    node.stop_plugin()
    record = node.data_dir / "claims" / f"{uid}.json"
    record.write_bytes(record.read_bytes()[:-7] + b"garbage")
    node.start_plugin()

    # Registration comes before start-up reconcile (calls wait at the start-up gate).
    wait_for(lambda: list(record.parent.glob(f"{uid}.json.corrupt-*")), what="a corrupt copy")
    assert checkpoint_claims(node)[uid]["state"] == "Prepared"
    (message,) = wait_for(
        lambda: _node_events(api, node, "CheckpointCorrupt"), what="a CheckpointCorrupt Event"
    )
    assert f"Corrupt checkpoint file(s): {record} (not JSON" in message
    assert (
        f"Rebuilt 1 prepared claim(s) ({namespace}/c) holding 0 MIG instance(s), 0 MPS "
        f"share(s) and 0 time-slice setting(s) from the CDI specs in {node.cdi_dir}, checked "
        "against the API server" in message
    )
    # The rebuilt record is enough to unprepare the claim when the pod goes.
    _pod_goes_and_nothing_is_left(api, namespace, node)


def test_checkpoint_of_a_newer_version_is_left_alone_and_reported(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    uid = _running_claim(api, namespace, node)

    node.stop_plugin()
    record = node.data_dir / "claims" / f"{uid}.json"
    document = json.loads(record.read_text())
    document["data"]["version"] = 9
    record.write_text(json.dumps(document))
    content = record.read_bytes()
    node.start_plugin()

    (message,) = wait_for(
        lambda: _node_events(api, node, "CheckpointVersionUnsupported"),
        what="a CheckpointVersionUnsupported Event",
    )
    assert f"{record} (schema version 9)" in message
    assert f"Rebuilt 1 prepared claim(s) ({namespace}/c)" in message
    assert node.plugin is not None and node.plugin.running()
    assert cdi_specs(node) == [f"{DRIVER}-claim_{uid}.json"]
    client.CoreV1Api(api).delete_namespaced_pod("p", namespace)
    wait_gone(api, namespace, "p")
    wait_for(lambda: cdi_specs(node) == [], timeout_s=30, what="the claim unprepared")
    assert record.read_bytes() == content  # a newer plugin's file is never touched
