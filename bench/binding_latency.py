"""What binding conditions add to an on-demand MIG pod's start: pod created -> Running, and
claim allocated -> PartitionReady, with and without them, side by side in one run.

    python -m bench.binding_latency [--pods 24] [--shared]

``--shared``: the same for a pod asking for a share of a shared GPU, whose free GPU carries
TenantReady (the plugin gives it to the pod's namespace before binding), then a third series on
the node with them while another pod of the namespace holds the GPU (no conditions left to
wait for).

One control plane (the real scheduler), two simulated GPU nodes (kubelet harness, plugin on
the simulated backend, GPU 0 on-demand MIG): one plugin with --binding-conditions=off
(partitions made in prepare), the other with binding conditions (auto, which the server
allows from 1.36). Pods alternate between the nodes, one at a time, so machine noise hits both
alike; each asks for a 1g.18gb partition and is deleted (its partition destroyed) before the
next. Printed: p50 and p99 per mode and their difference; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from bench.compare_table import Row, percentile, render
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

CLASSES = Path(__file__).resolve().parent.parent / "demo" / "deviceclasses.yaml"
NAMESPACE = "bench-binding"
READY = "gpu.flexgpu.dev/PartitionReady"
TENANT_READY = "gpu.flexgpu.dev/TenantReady"
MODES = {"without": "--binding-conditions=off", "with": "--binding-conditions=auto"}


def _share() -> dict[str, Any]:
    exactly = {
        "deviceClassName": "shared-gpu.flexgpu.dev",
        "capacity": {"requests": {"memory": "10Gi"}},
    }
    return {"requests": [{"name": "gpu", "exactly": exactly}]}


def _claim() -> dict[str, Any]:
    is_1g = 'device.attributes["gpu.flexgpu.dev"].profile == "1g.18gb"'
    return {
        "requests": [
            {
                "name": "mig",
                "exactly": {
                    "deviceClassName": "mig.flexgpu.dev",
                    "selectors": [{"cel": {"expression": is_1g}}],
                },
            }
        ]
    }


def _pod(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {
                    "name": "main",
                    "image": "none",
                    "command": ["/bin/sh", "-c", "sleep 60"],
                    "resources": {"claims": [{"name": "g"}]},
                }
            ],
            "resourceClaims": [{"name": "g", "resourceClaimName": name}],
        },
    }


def one_pod(
    api: Any, name: str, node: str, *, shared: bool = False, keep: bool = False
) -> tuple[float, float | None]:
    """Seconds from pod created to Running, and from claim allocated to its binding
    condition seen (None without binding conditions). ``keep``: the pod stays."""
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    condition = TENANT_READY if shared else READY
    devices = _share() if shared else _claim()
    resource.create_namespaced_resource_claim(
        NAMESPACE, {"metadata": {"name": name}, "spec": {"devices": devices}}
    )
    start = time.monotonic()
    core.create_namespaced_pod(NAMESPACE, _pod(name, node))
    allocated_at: float | None = None
    ready_at: float | None = None
    while True:
        now = time.monotonic()
        if now - start > 120:
            raise TimeoutError(f"pod {name} on {node} not Running after 120 s")
        claim = resource.read_namespaced_resource_claim(name, NAMESPACE)
        if allocated_at is None and claim.status and claim.status.allocation:
            allocated_at = now
        for entry in (claim.status.devices if claim.status else None) or []:
            if ready_at is None and any(
                c.type == condition and c.status == "True" for c in entry.conditions or []
            ):
                ready_at = now
        if core.read_namespaced_pod(name, NAMESPACE).status.phase == "Running":
            running = now - start
            break
        time.sleep(0.05)
    binding = ready_at - allocated_at if ready_at is not None and allocated_at else None
    if keep:
        return running, binding
    core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
    give_up = time.monotonic() + 60
    while _exists(core, name):
        if time.monotonic() > give_up:
            raise TimeoutError(f"pod {name} not gone after 60 s")
        time.sleep(0.1)
    resource.delete_namespaced_resource_claim(name, NAMESPACE)
    return running, binding


def _exists(core: Any, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, NAMESPACE)
    except client.ApiException as err:
        if err.status == 404:
            return False
        raise
    return True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=24, help="pods per mode (at least 20)")
    parser.add_argument(
        "--shared", action="store_true", help="shares of a shared GPU instead of MIG"
    )
    args = parser.parse_args()
    gpu_flag = "--shared-gpus=0" if args.shared else "--dynamic-mig-gpus=0"
    kind = "shared-GPU" if args.shared else "MIG"
    condition = "TenantReady" if args.shared else "PartitionReady"
    held: list[float] = []
    if args.pods < 20:
        parser.error(f"--pods must be at least 20 for a p99, got {args.pods}")
    load_before = os.getloadavg()[0]
    starts: dict[str, list[float]] = {m: [] for m in MODES}
    ready: list[float] = []
    with ControlPlane() as plane:
        api = plane.api_client()
        resource: Any = client.ResourceV1Api(api)
        for doc in yaml.safe_load_all(CLASSES.read_text()):
            resource.create_device_class(doc)
        core: Any = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        nodes = {
            mode: SimulatedGpuNode(
                plane.kubeconfig,
                f"bench-bind-{mode}",
                "h200-4",
                plugin_args=(gpu_flag, flag),
            )
            for mode, flag in MODES.items()
        }
        try:
            for node in nodes.values():
                node.start()
            for i in range(args.pods):
                for mode, node in nodes.items():
                    running, binding = one_pod(api, f"{mode}-{i}", node.name, shared=args.shared)
                    starts[mode].append(running)
                    if binding is not None:
                        ready.append(binding)
            if args.shared:
                # The namespace holds the GPU through one pod: the next ones find it
                # published with their tenant and no conditions.
                with_node = nodes["with"].name
                one_pod(api, "holder", with_node, shared=True, keep=True)
                for i in range(args.pods):
                    held.append(one_pod(api, f"held-{i}", with_node, shared=True)[0])
        finally:
            for node in nodes.values():
                node.cleanup()
    rows = [
        Row(
            f"pod created -> Running p{p}, s (flexgpu: with binding conditions)",
            percentile(starts["with"], p),
            percentile(starts["without"], p),
            2,
        )
        for p in (50, 99)
    ]
    if held:
        rows += [
            Row(
                f"pod created -> Running p{p}, s (flexgpu: with, GPU held by the namespace)",
                percentile(held, p),
                percentile(starts["without"], p),
                2,
            )
            for p in (50, 99)
        ]
    print(render(rows, reference="without"))
    print(
        f"added per {kind} pod on a free GPU: p50 {rows[0].flexgpu - rows[0].reference:+.2f} s, "
        f"p99 {rows[1].flexgpu - rows[1].reference:+.2f} s; "
        f"claim allocated -> {condition} seen: p50 {percentile(ready, 50):.2f} s, "
        f"p99 {percentile(ready, 99):.2f} s ({len(ready)} of {args.pods} pods); "
        f"{args.pods} pods per mode; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
