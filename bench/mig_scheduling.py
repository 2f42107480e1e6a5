"""How fast the real scheduler places pods whose claims ask for 1g MIG partitions on
dynamic-MIG nodes, against the same number of pods asking for whole GPUs on the same nodes.

    python -m bench.mig_scheduling [--nodes 4] [--pods 32] [--rounds 2]

Both kinds run in one process against one control plane, alternating, so machine noise hits
both alike. Reported: pods per second for each and the ratio (partition / whole).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher
from tools.cluster import ControlPlane, create_simulated_node

DRIVER = "gpu.flexgpu.dev"
CLASSES = {
    "gpu.flexgpu.dev": "gpu",
    "mig.flexgpu.dev": "mig",
}


def publish_nodes(api: Any, kube: KubeApi, count: int, folder: Path) -> list[str]:
    names = []
    for i in range(count):
        name = f"bench-mig-{i}"
        create_simulated_node(api, name)
        backend = SimulatedBackend.from_topology(
            "hgx-h100-8", name, state_path=folder / f"{name}.json"
        )
        devices = NodeDevices(backend, dynamic_mig=set(range(8)))
        publisher = SlicePublisher(kube, name)
        publisher.set_devices(devices.slice_devices(), devices.counter_sets())
        publisher.reconcile_once()
        names.append(name)
    return names


def ensure_classes(api: Any) -> None:
    resource: Any = client.ResourceV1Api(api)
    for name, kind in CLASSES.items():
        try:
            resource.create_device_class(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": name},
                    "spec": {
                        "selectors": [
                            {
                                "cel": {
                                    "expression": f'device.driver == "{DRIVER}" && '
                                    f'device.attributes["{DRIVER}"].type == "{kind}"'
                                }
                            }
                        ]
                    },
                }
            )
        except client.ApiException as err:
            if err.status != 409:
                raise


def run_batch(api: Any, namespace: str, kind: str, pods: int) -> float:
    """Creates `pods` pods with one claim each and returns seconds until all are bound."""
    resource: Any = client.ResourceV1Api(api)
    core: Any = client.CoreV1Api(api)
    selectors = []
    device_class = "gpu.flexgpu.dev"
    if kind == "mig":
        device_class = "mig.flexgpu.dev"
        selectors = [{"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "1g.10gb"'}}]
    template = f"t-{kind}"
    resource.create_namespaced_resource_claim_template(
        namespace,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": template},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "g",
                                "exactly": {
                                    "deviceClassName": device_class,
                                    "selectors": selectors,
                                },
                            }
                        ]
                    }
                }
            },
        },
    )
    start = time.perf_counter()
    for i in range(pods):
        core.create_namespaced_pod(
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{kind}-{i}"},
                "spec": {
                    "containers": [
                        {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
                    ],
                    "resourceClaims": [{"name": "g", "resourceClaimTemplateName": template}],
                },
            },
        )
    while True:
        listed = core.list_namespaced_pod(namespace).items
        if sum(1 for p in listed if p.spec.node_name) == pods:
            return time.perf_counter() - start
        if time.perf_counter() - start > 300:
            raise RuntimeError(f"{kind}: not all {pods} pods bound after 300 s")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--pods", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.pods > args.nodes * 8:
        parser.error("--pods must be at most 8 x --nodes (one whole GPU per pod)")
    rates: dict[str, list[float]] = {"whole": [], "mig": []}
    with ControlPlane() as plane:
        api = plane.api_client()
        ensure_classes(api)
        kube = KubeApi.from_kubeconfig(plane.kubeconfig)
        publish_nodes(api, kube, args.nodes, Path(tempfile.mkdtemp(prefix="fg-bench-")))
        core: Any = client.CoreV1Api(api)
        for round_ in range(args.rounds):
            for kind in ("whole", "mig") if round_ % 2 == 0 else ("mig", "whole"):
                namespace = f"b-{kind}-{round_}"
                core.create_namespace({"metadata": {"name": namespace}})
                while True:
                    try:
                        core.read_namespaced_service_account("default", namespace)
                        break
                    except client.ApiException:
                        time.sleep(0.1)
                seconds = run_batch(api, namespace, "gpu" if kind == "whole" else "mig", args.pods)
                rates[kind].append(args.pods / seconds)
                # Free the devices for the next batch: pods go, the claim controller deletes
                # their claims, and the scheduler sees the devices free again.
                core.delete_namespace(namespace)
                while (
                    core.list_namespaced_pod(namespace).items
                    or client.ResourceV1Api(api).list_namespaced_resource_claim(namespace).items
                ):
                    for pod in core.list_namespaced_pod(namespace).items:
                        core.delete_namespaced_pod(
                            pod.metadata.name, namespace, grace_period_seconds=0
                        )
                    time.sleep(0.2)
    whole, mig = statistics.median(rates["whole"]), statistics.median(rates["mig"])
    print(
        f"{args.pods} pods per batch on {args.nodes} simulated hgx-h100-8 nodes in dynamic "
        f"MIG ({args.nodes * 8} GPUs, {args.nodes * 8 * 26} published devices), "
        f"{args.rounds} rounds alternating"
    )
    print(
        f"  whole GPUs      {whole:6.1f} pods/s   (rounds: "
        f"{', '.join(f'{r:.1f}' for r in rates['whole'])})"
    )
    print(
        f"  1g partitions   {mig:6.1f} pods/s   (rounds: "
        f"{', '.join(f'{r:.1f}' for r in rates['mig'])})"
    )
    print(f"  ratio partition/whole: {mig / whole:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
