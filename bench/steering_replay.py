"""Node steering and consolidation in the autoscaler model of ``bench.autoscale_replay``: what
flexgpu's controller would do with ``driver.allocation.node_clearing`` and
``driver.allocation.consolidation``, minute by minute.

- Steering: every minute, the nodes that serve claims are described by what they hold and
  ``node_clearing.choose_nodes`` picks the ones to keep new claims off. The model's scheduler
  honours a steered node as kube-scheduler honours a NoSchedule device taint on all of its
  devices: no new claim goes there, except that a claim that fits on no other ready node
  releases one (``node_clearing.release_for``) and takes it. In a cluster that release costs
  one controller pass (seconds: the controller sees the claim pending and deletes the taint
  rule); the model does it within the minute.
- What the controller knows of a holder is its age; how long it will still run is not in any
  API object, so the model passes no expected end unless ``known_ends`` is set (a what-if).
- Eviction (only with ``evict_after_minutes``): a node steered for that long is emptied by
  moving its holders, when every holder may move (``consolidation.plan_gpu``'s rule, applied
  to a node's holders) and each fits on another ready node not steered, at most
  ``max_in_flight`` at a time (``consolidation.choose``). Inference claims are modelled as
  served by Deployments whose pod template carries ``flexgpu.dev/movable: "true"`` and whose
  claims come from a ResourceClaimTemplate; training claims as Jobs, which never move. An
  evicted claim starts again elsewhere at once and runs ``restart_minutes`` longer (pod start,
  image and model load), and is in flight until then; those minutes count as used GPU time.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from bench.autoscale_replay import (
    GPUS_PER_NODE,
    Claim,
    Cluster,
    SimNode,
    state_of,
)
from bench.autoscale_trace import BY_NAME
from flexgpu.driver.allocation import AllocatedState
from flexgpu.driver.allocation.consolidation import (
    JOB_OWNER,
    GpuPlan,
    Holder,
    HolderPod,
    choose,
    plan_gpu,
)
from flexgpu.driver.allocation.node_clearing import (
    DEFAULT_MAX_HELD_SHARE,
    GroupNode,
    NodeHolder,
    choose_nodes,
    release_for,
)
from flexgpu.driver.allocation.relocation import add_choices

# Served by Deployments that opted in (see the module docstring); the rest are Jobs.
MOVABLE_KINDS: Final = frozenset({"infer-mig-1g", "infer-mig-3g", "infer-share-20gi"})
DEPLOYMENT_OWNER: Final = "ReplicaSet.apps"
NAMESPACE: Final = "replay"


@dataclass(frozen=True)
class SteeringOptions:
    """Defaults: the chart's for GPU clearing (eviction after 10 minutes, one in flight, one
    hour at most), except ``share``: a node is 8 GPUs, so the chart's 0.1 would steer no node
    of a group under 10 nodes; 0.5 lets one node of two be steered."""

    share: float = 0.5  # of the cluster's GPUs steered at once
    max_held_share: float = DEFAULT_MAX_HELD_SHARE
    evict_after_minutes: int | None = 10  # None: nobody is moved
    max_in_flight: int = 1
    restart_minutes: int = 5
    known_ends: bool = False  # what-if: the controller knows when each holder ends
    # A node is steered at most this long at a time, then not again for as long (as GPU
    # clearing's maxDuration): a node held by a long Job would only push new claims elsewhere.
    max_steer_minutes: int | None = 60


@dataclass
class NodeSteering:
    """The ``bench.autoscale_replay.Steering`` of setup (d), with its counts."""

    options: SteeringOptions = field(default_factory=SteeringOptions)
    since: dict[str, int] = field(default_factory=dict)  # steered node -> minute steered
    allocated_at: dict[int, int] = field(default_factory=dict)  # moved claim -> minute
    restarting: dict[int, int] = field(default_factory=dict)  # moved claim -> restart ends
    started: int = 0  # nodes steered, counted each time one starts
    released: int = 0  # steerings ended because a claim fit nowhere else
    evictions: int = 0
    max_steered_gpus: int = 0
    group: list[GroupNode] = field(default_factory=list)  # as described at the last step
    resting: dict[str, int] = field(default_factory=dict)  # timed-out node -> steerable again

    def steered(self) -> frozenset[str]:
        return frozenset(self.since)

    def release(self, fits_on: Sequence[str], nodes: Sequence[SimNode], minute: int) -> str | None:
        name = release_for(fits_on, list(self.since), self.group)
        if name is not None:
            del self.since[name]
            self.released += 1
        return name

    def step(self, cluster: Cluster, running: dict[int, Claim], minute: int) -> None:
        for name in [n for n in self.since if n not in cluster.nodes]:
            del self.since[name]  # removed by the autoscaler: its steering ends with it
        longest = self.options.max_steer_minutes
        if longest is not None:
            for name, since in list(self.since.items()):
                if minute - since >= longest:
                    del self.since[name]
                    self.resting[name] = minute + longest
        self.resting = {n: until for n, until in self.resting.items() if until > minute}
        ready = [n for n in cluster.nodes.values() if n.ready_at <= minute]
        self.group = [self._describe(n, running, minute) for n in ready]
        chosen = choose_nodes(
            [n for n in self.group if n.name not in self.resting],
            total_gpus=len(cluster.nodes) * GPUS_PER_NODE,
            share=self.options.share,
            steered=self.since,
            max_held_share=self.options.max_held_share,
        )
        self.since = {name: self.since.get(name, minute) for name in chosen}
        self.started += sum(1 for name in chosen if self.since[name] == minute)
        self.max_steered_gpus = max(self.max_steered_gpus, len(chosen) * GPUS_PER_NODE)
        if self.options.evict_after_minutes is not None:
            self._evict(cluster, running, ready, minute)

    def _describe(self, node: SimNode, running: dict[int, Claim], minute: int) -> GroupNode:
        holders = []
        for index in sorted(node.claims):
            claim = running[index]
            allocated = self.allocated_at.get(index, claim.started or 0)
            ends = claim.ends_at
            remaining = (
                float((ends - minute) * 60)
                if self.options.known_ends and ends is not None
                else None
            )
            holders.append(
                NodeHolder(
                    f"{NAMESPACE}/{index}",
                    BY_NAME[claim.arrival.kind].gpus,
                    float((minute - allocated) * 60),
                    remaining,
                    movable=(
                        self.options.evict_after_minutes is not None
                        and claim.arrival.kind in MOVABLE_KINDS
                    ),
                )
            )
        return GroupNode(node.name, GPUS_PER_NODE, tuple(holders))

    def _evict(
        self, cluster: Cluster, running: dict[int, Claim], ready: list[SimNode], minute: int
    ) -> None:
        assert self.options.evict_after_minutes is not None
        self.restarting = {i: end for i, end in self.restarting.items() if end > minute}
        due = sorted(
            (since, name)
            for name, since in self.since.items()
            if minute - since >= self.options.evict_after_minutes
        )
        targets = [n for n in ready if n.name not in self.since]
        state = state_of(list(running.values()))
        plans: list[tuple[str, GpuPlan]] = []
        for _, name in due:
            claims = [running[i] for i in sorted(cluster.nodes[name].claims)]
            # Only a node whose every holder has room elsewhere now: moving some and leaving
            # one that cannot go costs restarts and removes no node.
            if claims and _all_fit(cluster, claims, targets, state):
                plans.append((name, plan_gpu([_holder(c) for c in claims])))
        picked = choose(plans, len(self.restarting), self.options.max_in_flight)
        for name, pod in picked:
            claim = running[int(pod.name)]
            for target in targets:
                devices = cluster.fit(claim.arrival.kind, target, state)
                if devices is None:
                    continue
                # The evicted pod's claim is deleted with it; its replacement's claim takes
                # devices on the target. Freed devices stay counted in ``state`` for this
                # pass: nothing else is placed in it.
                add_choices(state, devices)
                source = cluster.nodes[name]
                source.claims.discard(claim.index)
                if not source.claims:
                    source.idle_since = minute
                target.claims.add(claim.index)
                claim.node, claim.devices = target.name, devices
                claim.extra_minutes += self.options.restart_minutes
                self.allocated_at[claim.index] = minute
                self.restarting[claim.index] = minute + self.options.restart_minutes
                self.evictions += 1
                break


def _all_fit(
    cluster: Cluster, claims: Sequence[Claim], targets: Sequence[SimNode], state: AllocatedState
) -> bool:
    trial = copy.deepcopy(state)
    for claim in claims:
        for target in targets:
            devices = cluster.fit(claim.arrival.kind, target, trial)
            if devices is not None:
                add_choices(trial, devices)
                break
        else:
            return False
    return True


def _holder(claim: Claim) -> Holder:
    movable = claim.arrival.kind in MOVABLE_KINDS
    pod = HolderPod(
        namespace=NAMESPACE,
        name=str(claim.index),
        uid=str(claim.index),
        movable="true" if movable else None,
        controller=DEPLOYMENT_OWNER if movable else JOB_OWNER,
        ending=False,
    )
    return Holder(claim=f"{NAMESPACE}/{claim.index}", pod=pod)
