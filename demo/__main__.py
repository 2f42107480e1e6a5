"""`make demo`: starts the local cluster, publishes a simulated GPU node's devices, applies
the workload catalog in this folder and prints what the real scheduler allocated.

`make demo-down` (``python -m demo down``) stops the cluster."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, dynamic

from driver.names import DRIVER_NAME
from driver.resource_slice import render_whole_gpus
from driver.sim_backend import SimulatedBackend
from driver.topology import load_topology
from kubelet_plugin.slice_publisher import SlicePublisher
from tools.cluster import __main__ as cluster_cli
from tools.cluster import create_simulated_node

HERE = Path(__file__).resolve().parent
WORKDIR = HERE.parent / ".run" / "demo"
NAMESPACE = "flexgpu-demo"
NODES = {"gpu-node-h100": "hgx-h100-8"}


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def apply_file(dyn: dynamic.DynamicClient, path: Path, namespace: str | None) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        ns = namespace if resource.namespaced else None
        try:
            resource.create(body=doc, namespace=ns)
            print(f"  created {doc['kind']} {doc['metadata']['name']}")
        except client.ApiException as err:
            if err.status != 409:
                raise
            print(f"  exists  {doc['kind']} {doc['metadata']['name']}")


def claim_names(pod: Any) -> list[str]:
    """Claims a pod uses: named directly in its spec, or generated from a template."""
    names = [r.resource_claim_name for r in pod.spec.resource_claims or [] if r.resource_claim_name]
    names += [
        r.resource_claim_name
        for r in pod.status.resource_claim_statuses or []
        if r.resource_claim_name
    ]
    return names


def claim_rows(api: Any) -> list[tuple[str, str, str, str]]:
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    slices = resource.list_resource_slice(field_selector=f"spec.driver={DRIVER_NAME}").items
    product = {
        (s.spec.pool.name, d.name): d.attributes["productName"].string
        for s in slices
        for d in (s.spec.devices or [])
    }
    rows = []
    for pod in core.list_namespaced_pod(NAMESPACE).items:
        devices = []
        for name in claim_names(pod):
            claim = resource.read_namespaced_resource_claim(name, NAMESPACE)
            allocation = claim.status.allocation if claim.status else None
            for r in allocation.devices.results if allocation else []:
                devices.append(f"{r.device} ({product.get((r.pool, r.device), '?')})")
        rows.append(
            (
                str(pod.metadata.name),
                pod.spec.node_name or "-",
                str(pod.status.phase),
                ", ".join(devices) or "-",
            )
        )
    return sorted(rows)


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    headers = ("POD", "NODE", "PHASE", "DEVICES")
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    for row in (headers, *rows):
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def up() -> int:
    step("starting the local Kubernetes control plane")
    if cluster_cli.up(WORKDIR) != 0:
        return 1
    kubeconfig = WORKDIR / "kubeconfig"
    api = config.new_client_from_config(config_file=str(kubeconfig))
    dyn = dynamic.DynamicClient(api)

    for node, topology in NODES.items():
        step(f"simulated node {node} ({topology}): registering it and publishing its GPUs")
        create_simulated_node(api, node, labels={"flexgpu.dev/topology": topology})
        backend = SimulatedBackend(
            load_topology(topology), node, state_path=WORKDIR / "nodes" / node / "gpu-state.json"
        )
        publisher = SlicePublisher(api, node)
        publisher.set_devices(render_whole_gpus(backend.list_gpus()))
        publisher.reconcile_once()
        print(f"  published {len(backend.list_gpus())} GPUs in pool {node}")

    step("applying DeviceClasses and the workload catalog (demo/*.yaml)")
    core: Any = client.CoreV1Api(api)
    try:
        core.create_namespace({"metadata": {"name": NAMESPACE}})
    except client.ApiException as err:
        if err.status != 409:
            raise
    while True:
        try:
            core.read_namespaced_service_account("default", NAMESPACE)
            break
        except client.ApiException:
            time.sleep(0.2)
    apply_file(dyn, HERE / "deviceclasses.yaml", None)
    for manifest in sorted(HERE.glob("[0-9]*.yaml")):
        apply_file(dyn, manifest, NAMESPACE)

    step("waiting for the scheduler to allocate every claim")
    deadline = time.monotonic() + 60
    rows = claim_rows(api)
    while time.monotonic() < deadline and any(r[3] == "-" for r in rows):
        time.sleep(0.5)
        rows = claim_rows(api)
    print_table(rows)
    pending = [r[0] for r in rows if r[3] == "-"]
    print(
        f"\nThe cluster keeps running. Try:\n  export KUBECONFIG={kubeconfig}\n"
        f"  kubectl get resourceslices\n  kubectl -n {NAMESPACE} get resourceclaims -o wide\n"
        f"Logs: {WORKDIR / 'logs'}/   Stop it with: make demo-down"
    )
    if pending:
        print(f"not allocated: {', '.join(pending)}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    if sys.argv[1:] == ["down"]:
        return cluster_cli.down(WORKDIR)
    return up()


if __name__ == "__main__":
    sys.exit(main())
