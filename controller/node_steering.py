"""Node steering: keeping new claims off the nodes of a group closest to empty, so that they
empty as their holders end and an autoscaler can remove them. Nobody is moved unless
eviction is on (step 6).

Each pass (leader only, ``controller.active``, after GPU clearing's):

1. describes the nodes with flexgpu's GPUs (not cordoned) by what each claim holds there in
   GPU-equivalents (``driver.allocation.node_holders``) and the claims' allocation ages;
2. ends steering on a node that is gone (no flexgpu GPUs or deleted: "gone"), where GPU
   clearing now empties a GPU for a waiting claim ("clearing": that claim needs the node),
   or that has been steered longer than ``max_s`` ("timed_out": not steered again until as
   long again has passed);
3. chooses the nodes to steer (``driver.allocation.node_clearing.choose_nodes``: at most
   ``max_held_share`` held, the rest of the group has room for what they hold, at most
   ``share`` of the cluster's GPUs);
4. releases a chosen node for each pending claim the evaluator places only on chosen nodes
   (``release_for``): steering never makes a claim wait that fits somewhere now. The release
   holds while the claim waits, since the evaluator finds the same each pass;
5. deletes the rules of nodes no longer chosen ("released", "not_chosen") and creates one
   DeviceTaintRule per flexgpu pool of each newly chosen node (NoSchedule under
   ``flexgpu.dev/node-steering``, ``controller.taint_rules``);
6. with eviction on (``controller.node_eviction``): evicts the pods that opted in from the
   nodes steered longer than its bound, a few at a time, when every holder of the node may
   move and each has room elsewhere now (off the steered nodes and the GPUs being cleared).
   Only nodes steered after steps 2-5: a steering that ended evicts nothing more.

Rules outlive the process; a new leader lists them at its first pass and takes them over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Final, Protocol

from prometheus_client import Counter, Gauge

from flexgpu.controller.clearing import ClearingSink, since_wall
from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.evaluation import Memo, evaluate
from flexgpu.controller.events import EventTarget
from flexgpu.controller.node_eviction import NodeEvictions
from flexgpu.controller.pending import pending_claims
from flexgpu.controller.taint_rules import SteeringFor, SteeringRule
from flexgpu.driver.allocation.node_clearing import (
    DEFAULT_MAX_HELD_SHARE,
    GroupNode,
    choose_nodes,
    may_steer,
    release_for,
)
from flexgpu.driver.allocation.node_holders import group_nodes
from flexgpu.driver.durations import human_duration
from flexgpu.driver.names import DRIVER_NAME

log = logging.getLogger(__name__)

STARTED: Final = "GpuNodeSteering"
ENDED: Final = "GpuNodeSteeringEnded"
# A node is 8 GPUs in most groups: a share under 1/nodes steers no node at all (0.1 of a
# group of 9 such nodes is 7 GPUs, less than one node); 0.5 lets one node of two be steered.
DEFAULT_SHARE: Final = 0.5
DEFAULT_MAX_S: Final = 3600.0
RECHECK_S: Final = 10.0
# A pending claim counts for a release once its pod has waited this long: the scheduler has
# had its try, and a claim that fits only on a steered node does not wait much longer.
RELEASE_DELAY_S: Final = 5.0
OUTCOMES: Final = ("released", "not_chosen", "clearing", "gone", "timed_out")
_HOLDERS_NAMED: Final = 5

STEERED_NODES: Final = Gauge(
    "flexgpu_node_steering_nodes",
    "Nodes new claims are kept off so that they empty for an autoscaler (leader only)",
)
STEERING_STARTED: Final = Counter(
    "flexgpu_node_steering_started", "Nodes the leader started keeping new claims off"
)
STEERING_ENDED: Final = Counter(
    "flexgpu_node_steering_ended",
    "Node steerings ended, by outcome (" + ", ".join(OUTCOMES) + ")",
    ["outcome"],
)


class SteeringRuleStore(Protocol):
    def version(self) -> str | None: ...
    def list_steering(self) -> list[SteeringRule]: ...
    def steer(self, what: SteeringFor, driver: str, pool: str) -> str: ...
    def delete(self, name: str) -> None: ...


@dataclass
class SteeredNode:
    node: str
    since: float  # this process's clock
    rules: list[str] = field(default_factory=list)


def _validate(share: float, max_held_share: float, max_s: float) -> None:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"node steering share {share}: must be between 0 and 1")
    if not 0.0 <= max_held_share <= 1.0:
        raise ValueError(f"node steering max held share {max_held_share}: must be between 0 and 1")
    if max_s <= 0:
        raise ValueError(f"node steering max duration {max_s}: must be more than 0 seconds")


def _gpu_count(amount: float) -> str:
    return f"{amount:.3g}"


class NodeSteering:
    def __init__(
        self,
        rules: SteeringRuleStore,
        sink: ClearingSink,
        *,
        share: float = DEFAULT_SHARE,
        max_held_share: float = DEFAULT_MAX_HELD_SHARE,
        max_s: float = DEFAULT_MAX_S,
        node_labels: Mapping[str, str] | None = None,
        release_delay_s: float = RELEASE_DELAY_S,
        evictions: NodeEvictions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _validate(share, max_held_share, max_s)
        if evictions is not None and evictions.after_s >= max_s:
            # Steering would end before eviction is ever considered.
            raise ValueError(
                f"node steering eviction after {human_duration(evictions.after_s)}: must be "
                f"less than the node steering max duration ({human_duration(max_s)})"
            )
        self._evictions = evictions
        self._rules = rules
        self._sink = sink
        self._share = share
        self._max_held_share = max_held_share
        self._max_s = max_s
        self._node_labels = dict(node_labels or {})
        self._release_delay_s = release_delay_s
        self._clock = clock
        self._active: dict[str, SteeredNode] = {}
        self._resting: dict[str, float] = {}  # node -> when its steering timed out
        self._adopted = False
        self._last: tuple[int, frozenset[str], float] | None = None

    @property
    def active(self) -> Mapping[str, SteeredNode]:
        return self._active

    def forget(self) -> None:
        """Lost the lease: the rules stay for the next leader to take over."""
        self._active.clear()
        self._resting.clear()
        self._adopted = False
        self._last = None
        if self._evictions is not None:
            self._evictions.forget()
        STEERED_NODES.set(0)

    def _adopt(self, wall: datetime) -> None:
        now = self._clock()
        for info in self._rules.list_steering():
            steered = self._active.get(info.node)
            if steered is None:
                steered = SteeredNode(info.node, since_wall(info.since, wall, now))
                self._active[info.node] = steered
            steered.rules.append(info.name)
        self._adopted = True

    def run_pass(
        self,
        snapshot: Snapshot,
        wall: datetime,
        cleared_nodes: Collection[str] = (),
        cleared_gpus: Collection[str] = (),
    ) -> None:
        """``cleared_nodes``: nodes where GPU clearing empties a GPU for a waiting claim;
        ``cleared_gpus``: those GPUs (node/pool/uuid), no room for a pod eviction moves."""
        if self._rules.version() is None:
            return
        now = self._clock()
        cleared = frozenset(cleared_nodes)
        last = self._last
        if (
            last is not None
            and (last[0], last[1]) == (snapshot.revision, cleared)
            and now - last[2] < RECHECK_S
        ):
            return  # nothing changed: only the time bound and pods' ages moved
        self._last = (snapshot.revision, cleared, now)
        if not self._adopted:
            self._adopt(wall)
        group = self._group(snapshot, wall)
        by_name = {n.name: n for n in group}
        self._end_stale(by_name, cleared)
        total = sum(n.gpus for n in group)
        chosen = choose_nodes(
            [n for n in group if n.name not in self._resting and n.name not in cleared],
            total_gpus=total,
            share=self._share,
            steered=self._active,
            max_held_share=self._max_held_share,
        )
        released = self._releases(snapshot, wall, chosen, group)
        for name in [n for n in self._active if n not in chosen]:
            reason = released.get(name)
            outcome = "released" if reason is not None else "not_chosen"
            self._end(self._active[name], outcome, reason)
        for name in chosen:
            if name not in self._active:
                self._start(by_name[name], snapshot, group, chosen, wall)
        if self._evictions is not None:
            self._evictions.run(snapshot, list(self._active.values()), cleared_gpus)
        STEERED_NODES.set(len(self._active))

    def _group(self, snapshot: Snapshot, wall: datetime) -> list[GroupNode]:
        # A cordoned node is being drained or removed already: not steered, and its free
        # devices are no room for anyone.
        # Only the group the admin named (an autoscaled one): a fixed group's nodes are
        # neither steered nor counted as room for the steered nodes' work.
        nodes = [
            r.model
            for r in snapshot.nodes.values()
            if not r.unschedulable
            and all(r.model.labels.get(k) == v for k, v in self._node_labels.items())
        ]
        ages = {
            c.model.key: (wall - c.allocated_at).total_seconds()
            for c in snapshot.claims.values()
            if c.allocated_at is not None
        }
        group = group_nodes(nodes, snapshot.claim_models, snapshot.slice_index, ages, DRIVER_NAME)
        if self._evictions is None:
            return group
        # Where eviction is on, a node whose holders may all move ranks first: only the
        # holders of nodes that may be steered are asked about (their pods are read).
        asked = [h.claim for n in group if may_steer(n, self._max_held_share) for h in n.holders]
        movable = self._evictions.movable(snapshot, asked) if asked else frozenset()
        return [
            replace(n, holders=tuple(replace(h, movable=h.claim in movable) for h in n.holders))
            for n in group
        ]

    def _end_stale(self, group: Mapping[str, GroupNode], cleared: frozenset[str]) -> None:
        now = self._clock()
        for name, steered in list(self._active.items()):
            if name not in group:
                self._end(steered, "gone", None)
            elif name in cleared:
                self._end(steered, "clearing", None)
            elif now - steered.since >= self._max_s:
                self._resting[name] = now
                self._end(steered, "timed_out", None)
        for name, at in list(self._resting.items()):
            if now - at >= self._max_s:
                del self._resting[name]

    def _releases(
        self, snapshot: Snapshot, wall: datetime, chosen: list[str], group: list[GroupNode]
    ) -> dict[str, str]:
        """Takes out of ``chosen`` each node a pending claim needs; node -> the claim."""
        released: dict[str, str] = {}
        if not chosen:
            return released
        memo = Memo()
        for item in pending_claims(snapshot, wall, self._release_delay_s):
            evaluation = evaluate(snapshot, item.claim, item.pod, memo=memo)
            if not evaluation.satisfiable:
                continue  # fits nowhere now: GPU clearing's case, not this one
            name = release_for(evaluation.explanation.allocatable_nodes, chosen, group)
            if name is not None:
                chosen.remove(name)
                released[name] = item.claim.model.key
                if not chosen:
                    break
        return released

    def _end(self, steered: SteeredNode, outcome: str, claim: str | None) -> None:
        for name in list(steered.rules):
            self._rules.delete(name)
            steered.rules.remove(name)
        del self._active[steered.node]
        STEERING_ENDED.labels(outcome).inc()
        words = {
            "released": f"claim {claim} fits on no other node now",
            "not_chosen": "it holds more now, or the other nodes have too little room for it",
            "clearing": "GPU clearing empties one of its GPUs for a waiting claim",
            "gone": "the node has no flexgpu GPUs any more, or is cordoned",
            "timed_out": f"it did not empty within {human_duration(self._max_s)}",
        }[outcome]
        message = f"flexgpu no longer keeps new claims off node {steered.node}: {words}"
        log.info("%s", message)
        self._sink.emit(_node(steered.node), ENDED, message, repeat=False, event_type="Normal")

    def _start(
        self,
        node: GroupNode,
        snapshot: Snapshot,
        group: list[GroupNode],
        chosen: list[str],
        wall: datetime,
    ) -> None:
        model = next(n for n in snapshot.node_models if n.name == node.name)
        pools = sorted(p.name for p in snapshot.slice_index.pools(model) if p.driver == DRIVER_NAME)
        steered = SteeredNode(node.name, self._clock())
        # Registered before the first rule is created: a failure halfway still ends in _end.
        self._active[node.name] = steered
        what = SteeringFor(node.name, wall.strftime("%Y-%m-%dT%H:%M:%SZ"))
        for pool in pools:
            steered.rules.append(self._rules.steer(what, DRIVER_NAME, pool))
        STEERING_STARTED.inc()
        room = sum(n.free for n in group if n.name not in chosen)
        named = [h.claim for h in node.holders[:_HOLDERS_NAMED]]
        more = len(node.holders) - len(named)
        holders = ", ".join(named) + (f" and {more} more" if more > 0 else "")
        held = (
            f"it holds {_gpu_count(node.held)} of its {node.gpus} GPUs for "
            f"{len(node.holders)} claim(s) ({holders})"
            if node.holders
            else f"its {node.gpus} GPUs are free"
        )
        moved = "nobody is moved"
        if self._evictions is not None:
            moved = (
                f"after {human_duration(self._evictions.after_s)} the pods that opted in may "
                "be evicted, when all of its holders may move"
            )
        message = (
            f"flexgpu keeps new claims off node {node.name} so that it empties and an "
            f"autoscaler can remove it: {held}, and the group's other nodes have "
            f"{_gpu_count(room)} GPUs free; {moved}, and a claim that fits only here "
            f"ends this at once; at most {human_duration(self._max_s)}"
        )
        log.info("%s", message)
        self._sink.emit(_node(node.name), STARTED, message, repeat=False, event_type="Normal")


def _node(name: str) -> EventTarget:
    return EventTarget("Node", "v1", "", name, "")
