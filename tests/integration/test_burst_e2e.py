"""A burst on one node, through the real scheduler and plugin (binding conditions on, 1.36+):
pods asking for on-demand MIG partitions, fractions of a shared GPU and whole GPUs, all
created at once, with no controller running.

Over-subscribed, every claim that fits runs within seconds and the rest wait with the
scheduler's reason (FailedScheduling): fractions that fit never wait behind claims that do
not. Sized to fit, every pod runs. Afterwards nothing is left: no partition, no record, no
status write refused by the API server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    DRIVER,
    checkpoint_claims,
    env_from_log,
    granted,
    make_pod,
    scheduling_report,
)
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.requires_k8s(
        "1.36", why="binding conditions are beta and on by default from 1.36 (off before)"
    ),
]

NODE = "burst"
# GPUs 0-1 on-demand MIG, GPU 2 shared; 3-5 whole; 6-7 start in MIG mode without instances
# (hgx-h100-8), so they publish neither whole GPUs nor MIG devices.
ARGS = ("--dynamic-mig-gpus=0,1", "--shared-gpus=2")
SHARE = "4Gi"
# How long a pod that fits may take to run in a burst on 2 cores.
RUNS_WITHIN_S = 90


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(cluster, api, NODE, "hgx-h100-8", plugin_args=ARGS) as sim:
        yield sim


def _template(kind: str) -> dict[str, Any]:
    if kind == "mig":
        profile = f'device.attributes["{DRIVER}"].profile == "1g.10gb"'
        exactly = {
            "deviceClassName": "mig.flexgpu.dev",
            "selectors": [{"cel": {"expression": profile}}],
        }
    elif kind == "share":
        exactly = {
            "deviceClassName": "shared-gpu.flexgpu.dev",
            "capacity": {"requests": {"memory": SHARE}},
        }
    else:
        exactly = {"deviceClassName": "gpu.flexgpu.dev"}
    return {"spec": {"spec": {"devices": {"requests": [{"name": "g", "exactly": exactly}]}}}}


def _create_burst(api: Any, namespace: str, counts: dict[str, int]) -> list[tuple[str, str]]:
    """Templates first, then every pod at once; (pod name, kind) of each."""
    resources = client.ResourceV1Api(api)
    core = client.CoreV1Api(api)
    for kind in counts:
        resources.create_namespaced_resource_claim_template(
            namespace, {"metadata": {"name": kind}, **_template(kind)}
        )
    pods = [(f"{kind}-{i}", kind) for kind, n in counts.items() for i in range(n)]
    for name, kind in pods:
        pod = make_pod(
            name,
            "env | grep ^FLEXGPU_DEVICE_; echo DONE; sleep 600",
            {"g": {"resourceClaimTemplateName": kind}},
            node=NODE,
        )
        core.create_namespaced_pod(namespace, pod)
    return pods


def _phases(api: Any, namespace: str) -> dict[str, str]:
    return {
        p.metadata.name: p.status.phase
        for p in client.CoreV1Api(api).list_namespaced_pod(namespace).items
    }


def _unschedulable(api: Any, namespace: str) -> dict[str, str]:
    """Pod -> the scheduler's latest FailedScheduling message."""
    events = client.CoreV1Api(api).list_namespaced_event(namespace).items
    found: dict[str, str] = {}
    for event in sorted(events, key=lambda e: str(e.last_timestamp or e.event_time or "")):
        if event.reason == "FailedScheduling" and event.involved_object.kind == "Pod":
            found[event.involved_object.name] = event.message or ""
    return found


def _sim_instances(node: SimulatedGpuNode) -> list[dict[str, Any]]:
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    return [i for g in state["gpus"] for i in g["mig_instances"]]


def _delete_all(api: Any, namespace: str, node: SimulatedGpuNode) -> None:
    core = client.CoreV1Api(api)
    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    wait_for(lambda: not _phases(api, namespace), timeout_s=120, what="pods gone")
    wait_for(lambda: not _sim_instances(node), timeout_s=120, what="partitions destroyed")
    wait_for(
        lambda: not [r for r in checkpoint_claims(node).values() if r["namespace"] == namespace],
        timeout_s=120,
        what="claim records removed",
    )


def _check_containers(node: SimulatedGpuNode, namespace: str, running: list[str]) -> None:
    """Each running container got exactly one device of the kind its claim asked for."""
    for name in running:
        got = granted(env_from_log(node.container_log(namespace, name, "main")))
        assert len(got) == 1, (name, got)
        device = got[0]["device"]
        if name.startswith("mig-"):
            assert "-mig-1g10gb-" in device, (name, device)
        elif name.startswith("share-"):
            assert device == "gpu-2" and got[0].get("share"), (name, got)
        else:
            assert "-mig-" not in device and device not in ("gpu-2",), (name, device)


def _refused_writes(node: SimulatedGpuNode) -> list[str]:
    log = (node.root / "logs").glob("*plugin*")
    return [
        line
        for path in log
        for line in path.read_text(errors="replace").splitlines()
        if "status: 422" in line or "must be an allocated device" in line
    ]


def test_an_over_subscribed_burst_runs_what_fits_and_the_rest_waits_with_a_reason(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    counts = {"mig": 12, "share": 15, "whole": 5}
    started = time.monotonic()
    pods = _create_burst(api, namespace, counts)
    shares = [name for name, kind in pods if kind == "share"]
    # Fractions that fit (15 x 4Gi of an 80 GB GPU) never wait behind claims that do not.
    wait_for(
        lambda: all(_phases(api, namespace).get(p) == "Running" for p in shares),
        timeout_s=RUNS_WITHIN_S,
        interval_s=0.2,
        what="every fraction Running",
        explain=lambda: scheduling_report(api, namespace),
    )

    # Whatever else runs runs, the rest is reported unschedulable.
    def settled() -> dict[str, str] | None:
        phases = _phases(api, namespace)
        reasons = _unschedulable(api, namespace)
        waiting = [p for p, phase in phases.items() if phase != "Running"]
        return phases if all(p in reasons for p in waiting) else None

    phases = wait_for(settled, timeout_s=RUNS_WITHIN_S, what="every pod Running or unschedulable")
    took = time.monotonic() - started
    running = sorted(p for p, phase in phases.items() if phase == "Running")
    waiting = sorted(set(phases) - set(running))
    reasons = _unschedulable(api, namespace)
    print(
        f"\nburst: {len(pods)} pods, {len(running)} Running, {len(waiting)} waiting "
        f"({', '.join(sorted({reasons[p] for p in waiting})) or '-'}) after {took:.1f} s"
    )
    # Capacity: 14 1g.10gb placements on GPUs 0-1 unless whole claims take those GPUs, GPUs
    # 3-5 (and 0-1) whole: all 15 fractions and at least 3 whole GPUs and 7 partitions.
    by_kind = {k: sum(1 for p in running if p.startswith(k)) for k in counts}
    assert by_kind["share"] == 15 and by_kind["whole"] >= 3 and by_kind["mig"] >= 7, by_kind
    assert all("cannot allocate all claims" in reasons[p] for p in waiting), reasons
    _check_containers(node, namespace, running)
    _delete_all(api, namespace, node)
    assert _refused_writes(node) == []


def test_a_burst_sized_to_fit_runs_completely(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    counts = {"mig": 14, "share": 15, "whole": 3}
    started = time.monotonic()
    pods = _create_burst(api, namespace, counts)
    wait_for(
        lambda: sum(1 for v in _phases(api, namespace).values() if v == "Running") == len(pods),
        timeout_s=RUNS_WITHIN_S,
        what=f"all {len(pods)} pods Running",
    )
    print(
        f"\nburst sized to fit: {len(pods)} pods Running after {time.monotonic() - started:.1f} s"
    )
    _check_containers(node, namespace, [name for name, _ in pods])
    _delete_all(api, namespace, node)
    assert _refused_writes(node) == []
