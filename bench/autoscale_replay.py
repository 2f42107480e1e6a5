"""SIMULATION, not a measurement of a cluster: a day of GPU claims (``bench.autoscale_trace``)
replayed minute by minute against a fixed GPU node group sized for the day's peak and against
the same group autoscaled:

    python -m bench.autoscale_replay [--seed 7] [--days 1] [--boot-minutes 6]
        [--idle-minutes 10] [--max-nodes 40]

The node group: HGX H100 x8 nodes, GPUs 0-3 whole, 4-5 shared, 6-7 partitioned on demand
(MIG). Every node's slices are ``flexgpu node-template``'s for that group with the
placeholders filled in per node, and every placement is decided by flexgpu's offline copy of
the scheduler's allocator (``driver.allocation``, held to kube-scheduler by a differential
test): MIG placements, shares of a GPU's memory and NVLink sets pack as they would. Pending
claims are retried in arrival order whenever a claim ends, arrives or a node becomes ready.

The autoscaler is a model of cluster-autoscaler and Karpenter, not either of them: when claims
are pending it simulates them on the nodes already booting and then on new template nodes,
and launches the new ones; a node is ready ``--boot-minutes`` after launch (cloud boot, image
pull, plugin start) and billed from launch; a node without claims for ``--idle-minutes`` is
removed. The fixed group has as many nodes as the autoscaled run peaked at, all day.

Reported per run: GPU-hours provisioned (nodes x 8 x hours) against GPU-hours used (each
claim's GPU-equivalents x its run time), time from pending to running (median, p95, max) and
how many claims waited at all. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import yaml

from bench.autoscale_trace import BY_NAME, Arrival, day_trace
from flexgpu.driver.allocation import (
    AllocatedState,
    DeviceChoice,
    DeviceClass,
    Node,
    ResourceClaim,
    ResourceSlice,
    allocate,
    parse_claim,
    parse_device_class,
    parse_slice,
)
from flexgpu.driver.allocation.relocation import add_choices
from flexgpu.driver.allocation.selectors import SelectorCache
from flexgpu.driver.node_template import TemplatePolicy, is_placeholder
from flexgpu.driver.node_template import render_node_template as render
from flexgpu.driver.topology import load_topology

CLASSES_FILE: Final = Path(__file__).resolve().parents[1] / "demo" / "deviceclasses.yaml"
TOPOLOGY: Final = "hgx-h100-8"
GPUS_PER_NODE: Final = 8
GROUP_POLICY: Final = TemplatePolicy(shared=frozenset({4, 5}), dynamic_mig=frozenset({6, 7}))


class SliceTemplate(Protocol):
    """A node's slice specs with placeholders for what differs per node (``NodeTemplate``)."""

    @property
    def specs(self) -> list[dict[str, Any]]: ...


def device_classes() -> dict[str, DeviceClass]:
    docs = yaml.safe_load_all(CLASSES_FILE.read_text())
    return {d["metadata"]["name"]: parse_device_class(d) for d in docs}


def _fill(value: Any, node: str) -> Any:
    """The template's placeholders as one node's values: its name, and per-node strings."""
    if is_placeholder(value):
        return node if value == "<runtime:nodeName>" else f"{node}/{value[9:-1]}"
    if isinstance(value, dict):
        return {k: _fill(v, node) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, node) for v in value]
    return value


def node_slices(template: SliceTemplate, node: str) -> list[ResourceSlice]:
    return [
        parse_slice({"metadata": {"name": f"{node}-{i}"}, "spec": _fill(spec, node)})
        for i, spec in enumerate(template.specs)
    ]


@dataclass
class SimNode:
    name: str
    slices: list[ResourceSlice]
    launched: int
    ready_at: int
    idle_since: int
    claims: set[int] = field(default_factory=set)


@dataclass
class Claim:
    index: int
    arrival: Arrival
    started: int | None = None
    node: str | None = None
    devices: tuple[DeviceChoice, ...] = ()
    # Minutes added to its run by moves: an evicted claim starts again elsewhere.
    extra_minutes: int = 0

    @property
    def ends_at(self) -> int | None:
        if self.started is None:
            return None
        return self.started + self.arrival.minutes + self.extra_minutes


@dataclass
class Cluster:
    template: SliceTemplate
    classes: dict[str, DeviceClass]
    claim_objects: dict[str, ResourceClaim]
    selectors: SelectorCache = field(default_factory=SelectorCache)
    nodes: dict[str, SimNode] = field(default_factory=dict)
    launched: int = 0

    def launch(self, minute: int, ready_at: int) -> SimNode:
        name = f"gpu-node-{self.launched}"
        self.launched += 1
        node = SimNode(name, node_slices(self.template, name), minute, ready_at, ready_at)
        self.nodes[name] = node
        return node

    def fit(
        self, kind: str, node: SimNode, state: AllocatedState
    ) -> tuple[DeviceChoice, ...] | None:
        verdict = allocate(
            [self.claim_objects[kind]],
            Node(node.name, {"kubernetes.io/hostname": node.name}),
            node.slices,
            self.classes,
            state,
            selectors=self.selectors,
        )
        return verdict.devices[0] if verdict.allocatable else None


@dataclass
class RunResult:
    label: str
    claims: list[Claim]
    node_minutes: int
    peak_nodes: int
    used_gpu_minutes: float
    horizon: int  # minutes simulated
    # Per minute: nodes provisioned (booting or ready) and GPU-equivalents in use.
    nodes_by_minute: list[int]
    gpus_by_minute: list[float]


def state_of(claims: Sequence[Claim]) -> AllocatedState:
    state = AllocatedState()
    for claim in claims:
        add_choices(state, claim.devices)
    return state


class Steering(Protocol):
    """Keeps new claims off some nodes, as device taints would (``bench.steering_replay``)."""

    def steered(self) -> frozenset[str]: ...

    def release(self, fits_on: Sequence[str], nodes: Sequence[SimNode], minute: int) -> str | None:
        """The steered node a claim that fits on no other node may take (released now)."""
        ...

    def step(self, cluster: Cluster, running: dict[int, Claim], minute: int) -> None:
        """After the minute's placements and launches: choose what to steer, move what may."""
        ...


def replay(
    trace: Sequence[Arrival],
    cluster: Cluster,
    *,
    autoscale: bool,
    fixed_nodes: int,
    boot_minutes: int,
    idle_minutes: int,
    max_nodes: int,
    until: int = 0,
    steering: Steering | None = None,
) -> RunResult:
    """Minute by minute until every claim has run (or can never run) and, autoscaled, every
    node is gone; at least ``until`` minutes, so two runs can cover the same span. With
    ``steering``, steered nodes take a new claim only when it fits nowhere else."""
    claims = [Claim(i, a) for i, a in enumerate(trace)]
    for _ in range(fixed_nodes):
        cluster.launch(0, 0)
    pending: list[Claim] = []
    running: dict[int, Claim] = {}
    next_arrival = 0
    node_minutes = 0
    peak = len(cluster.nodes)
    used = 0.0
    nodes_by_minute: list[int] = []
    gpus_by_minute: list[float] = []
    minute = -1
    while True:
        minute += 1
        work_left = next_arrival < len(claims) or running
        if not work_left and minute >= until and not (autoscale and cluster.nodes):
            break
        changed = False
        for claim in list(running.values()):
            if (claim.ends_at or 0) <= minute:
                del running[claim.index]
                node = cluster.nodes[claim.node or ""]
                node.claims.discard(claim.index)
                if not node.claims:
                    node.idle_since = minute
                changed = True
        while next_arrival < len(claims) and claims[next_arrival].arrival.minute <= minute:
            pending.append(claims[next_arrival])
            next_arrival += 1
            changed = True
        changed |= any(n.ready_at == minute for n in cluster.nodes.values())
        if changed and pending:
            pending = schedule(cluster, pending, running, minute, steering)
        if autoscale and changed and pending:
            launch_for(
                cluster,
                pending,
                running,
                minute=minute,
                boot_minutes=boot_minutes,
                max_nodes=max_nodes,
            )
        if steering is not None:
            steering.step(cluster, running, minute)
        if autoscale:
            for node in list(cluster.nodes.values()):
                ready = node.ready_at <= minute
                if ready and not node.claims and minute - node.idle_since >= idle_minutes:
                    del cluster.nodes[node.name]
        node_minutes += len(cluster.nodes)
        peak = max(peak, len(cluster.nodes))
        in_use = sum(BY_NAME[c.arrival.kind].gpus for c in running.values())
        used += in_use
        nodes_by_minute.append(len(cluster.nodes))
        gpus_by_minute.append(in_use)
    return RunResult(
        "autoscaled" if autoscale else f"fixed ({fixed_nodes} nodes)",
        claims,
        node_minutes,
        peak,
        used,
        minute,
        nodes_by_minute,
        gpus_by_minute,
    )


def schedule(
    cluster: Cluster,
    pending: list[Claim],
    running: dict[int, Claim],
    minute: int,
    steering: Steering | None = None,
) -> list[Claim]:
    """Places what fits on ready nodes, in arrival order; returns what still waits. Steered
    nodes are left out unless a claim fits on no other node: then the steering releases one
    and the claim goes there, so steering never keeps a claim waiting that fits now."""
    state = state_of(list(running.values()))
    ready = [n for n in cluster.nodes.values() if n.ready_at <= minute]
    waiting: list[Claim] = []
    full: set[str] = set()  # kinds that found no room in this pass: the nodes only fill up
    for claim in pending:
        kind = claim.arrival.kind
        placed = None
        if kind not in full:
            steered = steering.steered() if steering is not None else frozenset()
            placed = _first_fit(cluster, kind, [n for n in ready if n.name not in steered], state)
            if placed is None and steering is not None and steered:
                fits = {
                    n.name: d
                    for n in ready
                    if n.name in steered and (d := cluster.fit(kind, n, state))
                }
                released = steering.release(list(fits), ready, minute)
                if released is not None:
                    placed = (cluster.nodes[released], fits[released])
        if placed is None:
            full.add(kind)
            waiting.append(claim)
            continue
        node, devices = placed
        add_choices(state, devices)
        claim.started, claim.node, claim.devices = minute, node.name, devices
        node.claims.add(claim.index)
        running[claim.index] = claim
    return waiting


def _first_fit(
    cluster: Cluster, kind: str, nodes: Sequence[SimNode], state: AllocatedState
) -> tuple[SimNode, tuple[DeviceChoice, ...]] | None:
    for node in nodes:
        devices = cluster.fit(kind, node, state)
        if devices is not None:
            return node, devices
    return None


def launch_for(
    cluster: Cluster,
    pending: Sequence[Claim],
    running: dict[int, Claim],
    *,
    minute: int,
    boot_minutes: int,
    max_nodes: int,
) -> None:
    """What an autoscaler does for pending claims: place them, in the simulation, on nodes
    already booting, then on new nodes of the template, and launch the new ones it used."""
    state = state_of(list(running.values()))
    booting = [n for n in cluster.nodes.values() if n.ready_at > minute]
    fresh: list[SimNode] = []
    for claim in pending:
        kind = claim.arrival.kind
        devices = None
        for node in booting + fresh:
            devices = cluster.fit(kind, node, state)
            if devices is not None:
                break
        if devices is None:
            if len(cluster.nodes) >= max_nodes:
                continue
            node = cluster.launch(minute, minute + boot_minutes)
            devices = cluster.fit(kind, node, state)
            if devices is None:  # fits no node of the group: launching helps nothing
                del cluster.nodes[node.name]
                continue
            fresh.append(node)
        add_choices(state, devices)


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def report(result: RunResult) -> list[str]:
    placed = [c for c in result.claims if c.started is not None]
    waits = [float(c.started - c.arrival.minute) for c in placed if c.started is not None]
    provisioned = result.node_minutes * GPUS_PER_NODE / 60
    used = result.used_gpu_minutes / 60
    waited = sum(1 for w in waits if w > 0)
    return [
        f"{result.label}",
        f"  GPU-hours provisioned {provisioned:8.1f}   used {used:7.1f}   "
        f"used/provisioned {used / provisioned:5.1%}   peak nodes {result.peak_nodes}",
        f"  pending->running min: median {statistics.median(waits) if waits else 0:.0f}, "
        f"p95 {percentile(waits, 0.95):.0f}, max {max(waits, default=0):.0f}   "
        f"claims that waited {waited} of {len(result.claims)}"
        + (
            f"   never placed {len(result.claims) - len(placed)}"
            if len(placed) < len(result.claims)
            else ""
        ),
    ]


def by_kind(result: RunResult) -> list[str]:
    lines = []
    for kind in BY_NAME:
        mine = [c for c in result.claims if c.arrival.kind == kind and c.started is not None]
        waits = [float(c.started - c.arrival.minute) for c in mine if c.started is not None]
        lines.append(
            f"    {kind:18s} {len(mine):4d} claims   wait p95 {percentile(waits, 0.95):4.0f} min"
            f"   max {max(waits, default=0):4.0f} min"
        )
    return lines


def hourly_figure(fixed: RunResult, scaled: RunResult, trace: Sequence[Arrival]) -> list[str]:
    """Per hour: claims arriving, GPU-equivalents in use (hour mean), GPUs provisioned by each
    group (hour mean), and a bar of the autoscaled group's GPUs (#) against use (=)."""
    lines = ["hour  arrived  GPUs used  GPUs fixed  GPUs autoscaled"]
    for hour in range((max(fixed.horizon, scaled.horizon) + 59) // 60):
        span = slice(hour * 60, (hour + 1) * 60)
        arrived = sum(1 for a in trace if a.minute // 60 == hour)
        used = statistics.fmean(scaled.gpus_by_minute[span] or [0.0])
        fixed_gpus = statistics.fmean(fixed.nodes_by_minute[span] or [0]) * GPUS_PER_NODE
        scaled_gpus = statistics.fmean(scaled.nodes_by_minute[span] or [0]) * GPUS_PER_NODE
        bar = "=" * round(used / 2) + "#" * max(0, round(scaled_gpus / 2) - round(used / 2))
        lines.append(
            f"{hour:4d}  {arrived:7d}  {used:9.1f}  {fixed_gpus:10.0f}  {scaled_gpus:15.1f}  {bar}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autoscale_replay", description=__doc__)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--days", type=int, default=1)
    parser.add_argument("--boot-minutes", type=int, default=6)
    parser.add_argument("--idle-minutes", type=int, default=10)
    parser.add_argument("--max-nodes", type=int, default=40)
    args = parser.parse_args(argv)
    trace = day_trace(args.seed, args.days)
    template = render(load_topology(TOPOLOGY), GROUP_POLICY)
    classes = device_classes()
    objects = {name: parse_claim(kind.claim_body()) for name, kind in BY_NAME.items()}
    print(
        f"SIMULATION: {len(trace)} claims over {args.days} day(s), seed {args.seed}; node group "
        f"{TOPOLOGY} (GPUs 0-3 whole, 4-5 shared, 6-7 on-demand MIG); boot "
        f"{args.boot_minutes} min, scale-down after {args.idle_minutes} idle min"
    )
    counts = {k: sum(1 for a in trace if a.kind == k) for k in BY_NAME}
    print("claims: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    options = {
        "boot_minutes": args.boot_minutes,
        "idle_minutes": args.idle_minutes,
        "max_nodes": args.max_nodes,
    }
    scaled = replay(
        trace,
        Cluster(template, classes, objects),
        autoscale=True,
        fixed_nodes=0,
        **options,
    )
    fixed = replay(
        trace,
        Cluster(template, classes, objects),
        autoscale=False,
        fixed_nodes=scaled.peak_nodes,
        until=scaled.horizon,
        **options,
    )
    print()
    for result in (fixed, scaled):
        print("\n".join(report(result)))
        print("\n".join(by_kind(result)))
    print()
    print("\n".join(hourly_figure(fixed, scaled, trace)))
    saved = 1 - scaled.node_minutes / fixed.node_minutes
    print()
    print(f"autoscaled provisions {saved:.0%} fewer GPU-hours than the fixed group")
    return 0


if __name__ == "__main__":
    sys.exit(main())
