"""What the shared-GPU tenant selector costs the real scheduler, with and without it, side by
side in one run:

    python -m bench.tenant_scheduling [--nodes 50] [--pods 40] [--rounds 3] [--tenants 4]

Hollow HGX H100 nodes published as flexgpu publishes them (GPUs 0-3 dynamic MIG, 4-5 shared,
6-7 whole). Two variants alternate within every round, so machine noise hits both alike:

* ``plain``: shared GPUs without the ``tenant`` attribute, claims without a tenant selector
  (flexgpu with ``sharedGpuTenants: any``);
* ``tenant``: shared GPUs with ``tenant`` (GPU 4 of every node serves another namespace,
  GPU 5 is free), every claim with the selector admission adds for its namespace
  (``controller.tenant_selector``), so each claim must pass over GPU 4.

Per batch, ``--pods`` pods with one 10 GiB share each, from ``--tenants`` namespaces, are
created, then their claims by several callers at once; each pod's scheduling latency is the
time from its claim's creation to its binding, seen through a watch. After a ``tenant`` batch
the bench does what the nodes' plugins would do once the pods' claims are prepared and later
unprepared: it republishes every node whose GPU 5 changed tenant, twice (to the namespace,
then back to ""), writing each slice of the pool whose content changed (a new pool
generation rewrites them all), and counts those writes. Reported: p50 and p99 latency per
variant and their ratio (tenant / plain), the scheduler's CPU ms per pod, slice writes per
pod, and how many GPUs a batch put two namespaces on (claims created at the same instant,
before any republish: the race window that prepare's guard closes). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch

from bench.compare_table import percentile
from bench.scale_cluster import (
    clear_namespace,
    create_nodes,
    ensure_classes,
    make_namespace,
    parallel,
    process_cpu_s,
    settle,
    unpublish,
    wait_for,
)
from bench.scale_publications import NodeInventory, scratch
from flexgpu.controller.tenant_selector import tenant_expression
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.resource_slice import slice_specs
from tools.cluster import ControlPlane

VARIANTS = ("plain", "tenant")
LABEL = "bench.flexgpu.dev/publication"
OTHERS = "other-team"
BATCH_DEADLINE_S = 240.0


@dataclass
class Figures:
    latency_s: dict[str, list[float]] = field(default_factory=dict)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    writes: list[int] = field(default_factory=list)
    write_s: list[float] = field(default_factory=list)
    mixed: dict[str, list[int]] = field(default_factory=dict)
    pods: dict[str, int] = field(default_factory=dict)


class Publisher:
    """The slices of every node as its plugin would write them, generation by generation."""

    def __init__(self, api: Any, nodes: dict[str, NodeInventory]) -> None:
        self.api = api
        self.nodes = nodes
        self.generation = dict.fromkeys(nodes, 1)
        self.current: dict[str, list[dict[str, Any]]] = {}

    def specs(self, node: str, tenants: dict[int, str] | None) -> list[dict[str, Any]]:
        devices = self.nodes[node].devices
        devices.publish_tenants = tenants is not None
        devices.set_tenants(tenants or {})
        return slice_specs(
            node, devices.slice_devices(), self.generation[node], devices.counter_sets()
        )

    def publish(self, variant: str) -> None:
        resource: Any = client.ResourceV1Api(self.api)
        tenants = {4: OTHERS} if variant == "tenant" else None

        def one(node: str) -> None:
            self.generation[node] = 1
            specs = self.specs(node, tenants)
            for i, spec in enumerate(specs):
                body = {
                    "metadata": {"name": f"{node}-{DRIVER_NAME}-{i}", "labels": {LABEL: variant}},
                    "spec": spec,
                }
                resource.create_resource_slice(body)
            self.current[node] = specs

        parallel(one, list(self.nodes))

    def republish(self, node: str, tenants: dict[int, str]) -> int:
        """Writes the node's slices for ``tenants``; returns how many it wrote."""
        resource: Any = client.ResourceV1Api(self.api)
        self.generation[node] += 1
        specs = self.specs(node, tenants)
        wrote = 0
        for i, spec in enumerate(specs):
            if i < len(self.current[node]) and self.current[node][i] == spec:
                continue
            name = f"{node}-{DRIVER_NAME}-{i}"
            stored = resource.read_resource_slice(name)
            body = client.ApiClient().sanitize_for_serialization(stored)
            body["spec"] = spec
            resource.replace_resource_slice(name, body)
            wrote += 1
        self.current[node] = specs
        return wrote


def _claim(name: str, namespace: str, variant: str) -> dict[str, Any]:
    exactly: dict[str, Any] = {
        "deviceClassName": "shared-gpu.flexgpu.dev",
        "capacity": {"requests": {"memory": "10Gi"}},
    }
    if variant == "tenant":
        exactly["selectors"] = [{"cel": {"expression": tenant_expression(namespace)}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "g", "exactly": exactly}]}},
    }


def _pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench": "tenant"}},
        "spec": {
            "containers": [
                {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
            ],
            "resourceClaims": [{"name": "g", "resourceClaimName": name}],
            "terminationGracePeriodSeconds": 0,
        },
    }


class BindWatch:
    """When each pod labelled bench=tenant was first seen bound, from a watch of all pods."""

    def __init__(self, api: Any) -> None:
        self.bound: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._watch = watch.Watch()
        self._core: Any = client.CoreV1Api(api)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in self._watch.stream(
                    self._core.list_pod_for_all_namespaces,
                    label_selector="bench=tenant",
                    timeout_seconds=30,
                ):
                    pod = event["object"]
                    key = (pod.metadata.namespace, pod.metadata.name)
                    if pod.spec.node_name and key not in self.bound:
                        self.bound[key] = time.perf_counter()
            except Exception:  # a dropped watch is reopened; the bench reports what it saw
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._watch.stop()


def batch(
    api: Any,
    binds: BindWatch,
    *,
    variant: str,
    spaces: list[str],
    pods: int,
    scheduler_pid: int | None,
) -> tuple[list[float], float, dict[str, set[str]]]:
    """Per-pod latencies, scheduler CPU ms per pod, and each node-GPU's namespaces."""
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    work = [(spaces[i % len(spaces)], f"p{i}") for i in range(pods)]
    for ns in spaces:
        make_namespace(api, ns)
    parallel(lambda w: core.create_namespaced_pod(w[0], _pod(w[1])), work)
    settle(scheduler_pid)
    cpu0 = process_cpu_s(scheduler_pid)
    created: dict[tuple[str, str], float] = {}

    def create(w: tuple[str, str]) -> None:
        created[w] = time.perf_counter()
        resource.create_namespaced_resource_claim(w[0], _claim(w[1], w[0], variant))

    parallel(create, work)
    wait_for(
        lambda: all(w in binds.bound for w in work),
        BATCH_DEADLINE_S,
        f"{pods} {variant} pods bound",
    )
    cpu = process_cpu_s(scheduler_pid) - cpu0
    latencies = [binds.bound[w] - created[w] for w in work]
    holders: dict[str, set[str]] = {}
    for ns, name in work:
        got: Any = resource.read_namespaced_resource_claim(name, ns)
        result = got.status.allocation.devices.results[0]
        holders.setdefault(f"{result.pool}/{result.device}", set()).add(ns)
    return latencies, cpu * 1000 / pods, holders


def run(args: argparse.Namespace, figures: Figures) -> None:
    names = [f"gpu-node-{i:03d}" for i in range(args.nodes)]
    with ControlPlane() as plane:
        api = plane.api_client()
        ensure_classes(api)
        nodes = create_nodes(api, names, scratch())
        pid = plane.component("kube-scheduler").pid
        binds = BindWatch(api)
        publisher = Publisher(api, nodes)
        try:
            for round_ in range(args.rounds):
                order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    publisher.publish(variant)
                    spaces = [f"{variant}-{round_}-t{t}" for t in range(args.tenants)]
                    latencies, cpu, holders = batch(
                        api,
                        binds,
                        variant=variant,
                        spaces=spaces,
                        pods=args.pods,
                        scheduler_pid=pid,
                    )
                    figures.latency_s.setdefault(variant, []).extend(latencies)
                    figures.cpu_ms.setdefault(variant, []).append(cpu)
                    figures.pods[variant] = figures.pods.get(variant, 0) + args.pods
                    mixed = sum(1 for held in holders.values() if len(held) > 1)
                    figures.mixed.setdefault(variant, []).append(mixed)
                    line = (
                        f"  round {round_ + 1} {variant:7s} p50 "
                        f"{1000 * percentile(latencies, 50):6.0f} ms  p99 "
                        f"{1000 * percentile(latencies, 99):6.0f} ms  scheduler {cpu:5.0f} ms"
                        f" CPU/pod  GPUs with two namespaces {mixed}"
                    )
                    if variant == "tenant":
                        wrote, seconds = _plugins_republish(publisher, holders)
                        figures.writes.append(wrote)
                        figures.write_s.append(seconds)
                        line += f"  slice writes {wrote} ({seconds:.1f} s)"
                    print(line, flush=True)
                    for ns in spaces:
                        clear_namespace(api, ns)
                    unpublish(api)
        finally:
            binds.stop()


def _plugins_republish(publisher: Publisher, holders: dict[str, set[str]]) -> tuple[int, float]:
    """What the nodes' plugins write: GPU 5 of each node that got claims turns to their
    namespace when the first is prepared, and back to "" when the last is unprepared."""
    start = time.perf_counter()
    wrote = 0
    for where, namespaces in holders.items():
        node, device = where.split("/")
        if device != "gpu-5":
            continue
        wrote += publisher.republish(node, {4: OTHERS, 5: min(namespaces)})
        wrote += publisher.republish(node, {4: OTHERS})
    return wrote, time.perf_counter() - start


def report(args: argparse.Namespace, figures: Figures) -> None:
    print()
    print(
        f"{args.nodes} nodes x 8 H100 (2 shared), {args.pods} pods of {args.tenants} "
        f"namespaces per batch, {args.rounds} rounds, variants alternating"
    )
    print(f"{'variant':9s}{'pods':>6s}{'p50 ms':>9s}{'p99 ms':>9s}{'sched CPU ms/pod':>18s}")
    p: dict[tuple[str, int], float] = {}
    for variant in VARIANTS:
        values = figures.latency_s.get(variant, [])
        if not values:
            continue
        p[(variant, 50)], p[(variant, 99)] = percentile(values, 50), percentile(values, 99)
        print(
            f"{variant:9s}{figures.pods[variant]:6d}{1000 * p[(variant, 50)]:9.0f}"
            f"{1000 * p[(variant, 99)]:9.0f}{statistics.median(figures.cpu_ms[variant]):18.0f}"
        )
    if ("plain", 50) in p and ("tenant", 50) in p:
        cpu = {v: statistics.median(figures.cpu_ms[v]) for v in VARIANTS}
        print(
            f"tenant / plain: p50 {p[('tenant', 50)] / p[('plain', 50)]:.2f}, "
            f"p99 {p[('tenant', 99)] / p[('plain', 99)]:.2f}, scheduler CPU "
            f"{cpu['tenant'] / cpu['plain']:.2f}"
        )
    if figures.writes:
        pods = figures.pods["tenant"]
        print(
            f"slice writes for tenant changes: {sum(figures.writes)} for {pods} pods "
            f"({sum(figures.writes) / pods:.2f} per pod; plain: 0), "
            f"{sum(figures.write_s):.1f} s of writes in all"
        )
    for variant, counts in figures.mixed.items():
        print(f"GPUs given two namespaces in a batch ({variant}): {counts}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--pods", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=4)
    args = parser.parse_args(argv)
    if args.pods > args.nodes * 8:
        parser.error("--pods: at most 8 shares per node fit on its free shared GPU")
    figures = Figures()
    try:
        run(args, figures)
    finally:
        report(args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
