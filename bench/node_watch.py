"""A GPU node's API footprint for the binding-conditions claim watch, before (every node
watches every claim of the cluster) and after (the controller labels allocated claims with
their node and each node watches its own label), at 100 and 500 hollow nodes on a real
control plane, extrapolated to 5,000.

Each hollow node is a Node object and the plugin's own watch code (bench/node_watchers.py),
not a whole plugin: the machine has 2 cores. Claims are created, allocated (status written as
the scheduler writes it) on one of ``BUSY`` nodes and deleted, ``BATCH`` at a time; in the
"after" rounds each batch is deleted once the controller labelled it, as a claim lives while
its pod runs. What a node receives is counted on its connection: watch events (bookmarks
included) with their bytes, and its requests. A claim change is one of the three writes
around a pod (create, allocate, delete); the controller's label write is overhead counted
in what nodes receive and in the API server's CPU, not a change. Figures per node:
- idle nodes (not ``BUSY``): events and bytes received per claim change elsewhere;
- busy nodes: events received per change of their own claims;
- requests per minute at rest (``--rest-s`` without churn) and under churn;
- lease events per minute at rest ("after": the controller's renewals);
- the API server's CPU seconds (its /proc/<pid>/stat) per claim lifecycle under churn.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from bench.node_watchers import (
    HollowNode,
    LabellingController,
    allocated_claim,
    labelled,
    lease_marked,
)
from bench.procstat import cpu_seconds
from tools.cluster import ControlPlane, create_simulated_node

NAMESPACE = "bench-node-watch"
BUSY = 10
BATCH = 10
# The extrapolation's cluster churn: claim changes per node per minute (one pod per node
# per minute: create, allocate, delete).
CHANGES_PER_NODE_MIN = 3.0


@dataclass
class Figures:
    nodes: int
    mode: str
    changes: int = 0
    idle_events: float = 0.0  # per node, per claim change elsewhere
    idle_bytes: float = 0.0
    busy_events: float = 0.0  # per node, per change of its own claims
    busy_bytes: float = 0.0
    rest_rpm: float = 0.0
    churn_rpm: float = 0.0
    lease_events_min: float = 0.0
    lease_bytes_min: float = 0.0
    cpu_ms_per_claim: float = 0.0


def _parallel(fn: Any, items: list[Any]) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(fn, items))


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def _round(
    plane: ControlPlane, api: Any, *, count: int, mode: str, claims: int, rest_s: float
) -> Figures:
    figures = Figures(count, mode)
    controller = LabellingController(plane.api_client()) if mode == "after" else None
    if controller is not None:
        controller.start()
        _wait(lambda: lease_marked(api), 60, "the controller's lease marked")
    lease = controller.lease if controller is not None else ""
    nodes = [HollowNode(plane.kubeconfig, f"bench-node-{i:04d}", lease) for i in range(count)]
    try:
        _parallel(HollowNode.start, nodes)
        _wait(lambda: all(n.claims and n.claims.synced for n in nodes), 120, "watches synced")
        want = "labelSelector" if mode == "after" else None
        assert all(next(iter(n.query()), None) == want for n in nodes), mode
        for node in nodes:
            node.api.reset()
        time.sleep(rest_s)
        minutes = rest_s / 60
        figures.rest_rpm = sum(n.api.requests() for n in nodes) / count / minutes
        figures.lease_events_min = sum(n.api.lease_events.events for n in nodes) / count / minutes
        figures.lease_bytes_min = sum(n.api.lease_events.bytes for n in nodes) / count / minutes
        for node in nodes:
            node.api.reset()
        apiserver = plane.component("kube-apiserver").pid
        assert apiserver is not None
        cpu0, t0 = cpu_seconds(apiserver), time.monotonic()
        resource: Any = client.ResourceV1Api(api)
        for start in range(0, claims, BATCH):
            batch = [f"{mode}-{count}-{i:05d}" for i in range(start, min(start + BATCH, claims))]
            for i, name in enumerate(batch):
                allocated_claim(api, NAMESPACE, name, nodes[(start + i) % BUSY].name)
            if controller is not None:
                _wait(lambda b=batch: all(labelled(api, NAMESPACE, c) for c in b), 60, "labels")
            for name in batch:
                resource.delete_namespaced_resource_claim(name, NAMESPACE)
        busy = nodes[:BUSY]
        _wait(lambda: not any(n.claims and n.claims.items() for n in busy), 60, "busy drained")
        time.sleep(1.0)  # the last deletions reach the idle nodes too
        cpu1, t1 = cpu_seconds(apiserver), time.monotonic()
        figures.changes = 3 * claims
        idle = nodes[BUSY:]
        figures.idle_events = (
            sum(n.api.claim_events.events for n in idle) / len(idle) / (figures.changes)
        )
        figures.idle_bytes = (
            sum(n.api.claim_events.bytes for n in idle) / len(idle) / (figures.changes)
        )
        own = figures.changes / BUSY
        figures.busy_events = sum(n.api.claim_events.events for n in busy) / BUSY / own
        figures.busy_bytes = sum(n.api.claim_events.bytes for n in busy) / BUSY / own
        figures.churn_rpm = sum(n.api.requests() for n in nodes) / count / ((t1 - t0) / 60)
        figures.cpu_ms_per_claim = (cpu1 - cpu0) * 1000 / claims
    finally:
        _parallel(HollowNode.stop, nodes)
        if controller is not None:
            controller.stop()
    return figures


def _report(rows: list[Figures], sizes: list[int], claims: int, load: tuple[float, float]) -> None:
    print(
        f"\nPer GPU node, binding-conditions claim watch ({claims} claims per round, "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after)"
    )
    header = (
        f"{'nodes':>6} {'mode':<7} {'ev/chg elsewhere':>16} {'B/chg elsewhere':>15} "
        f"{'ev/own chg':>10} {'req/min rest':>12} {'req/min churn':>13} "
        f"{'lease ev/min':>12} {'apiserver ms/claim':>18}"
    )
    print(header)
    for f in rows:
        print(
            f"{f.nodes:>6} {f.mode:<7} {f.idle_events:>16.3f} {f.idle_bytes:>15.0f} "
            f"{f.busy_events:>10.2f} {f.rest_rpm:>12.2f} {f.churn_rpm:>13.2f} "
            f"{f.lease_events_min:>12.1f} {f.cpu_ms_per_claim:>18.1f}"
        )
    by = {(f.nodes, f.mode): f for f in rows}
    small, large = min(sizes), max(sizes)
    if small != large and (small, "after") in by and (large, "after") in by:
        a, b = by[(small, "after")], by[(large, "after")]

        def growth(x: float, y: float) -> str:
            return f"{(y - x) / x * 100:+.1f}%" if x else ("0 -> 0" if not y else f"0 -> {y:.3g}")

        print(
            f"after, {small} -> {large} nodes: bytes per change elsewhere "
            f"{growth(a.idle_bytes, b.idle_bytes)}, events per own change "
            f"{growth(a.busy_events, b.busy_events)}, lease events/min "
            f"{growth(a.lease_events_min, b.lease_events_min)}"
        )
    r = CHANGES_PER_NODE_MIN
    print(
        f"\nExtrapolated to 5,000 nodes, each with {r:g} claim changes per minute "
        "(one pod per node per minute):\n"
        "  before: bytes/min per node = N x r x B_elsewhere   (every change reaches every node)\n"
        "  after:  bytes/min per node = r x B_own + L         (own changes, plus lease renewals)\n"
        "  with B_elsewhere = bytes per change elsewhere, B_own = bytes per own change, "
        "L = lease bytes/min (measured at the largest size)"
    )
    before, after = by.get((large, "before")), by.get((large, "after"))
    if before and after:
        n = 5000
        print(
            f"  before: {n} x {r:g} x {before.idle_bytes:.0f} B = "
            f"{n * r * before.idle_bytes / 1e6:.1f} MB/min per node"
        )
        print(
            f"  after:  {r:g} x {after.busy_bytes:.0f} B + {after.lease_bytes_min:.0f} B = "
            f"{(r * after.busy_bytes + after.lease_bytes_min) / 1e3:.1f} kB/min per node"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--claims", type=int, default=100, help="claims per round")
    parser.add_argument("--rest-s", type=float, default=30.0, help="seconds measured at rest")
    args = parser.parse_args()
    if args.claims < BATCH or min(args.nodes) <= BUSY:
        parser.error(f"--claims must be at least {BATCH} and --nodes above {BUSY}")
    load0 = os.getloadavg()[0]
    rows: list[Figures] = []
    with ControlPlane() as plane:
        api = plane.api_client()
        core: Any = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        names = [f"bench-node-{i:04d}" for i in range(max(args.nodes))]
        _parallel(lambda name: create_simulated_node(api, name), names)
        for count in sorted(args.nodes):
            for mode in ("before", "after"):
                rows.append(
                    _round(
                        plane, api, count=count, mode=mode, claims=args.claims, rest_s=args.rest_s
                    )
                )
                print(rows[-1], flush=True)
    _report(rows, args.nodes, args.claims, (load0, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
