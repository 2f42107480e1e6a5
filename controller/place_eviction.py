"""Evicting the pods that may move from a place flexgpu has steered too long (leader only):
one GPU that GPU clearing empties for a waiting claim (``controller.clearing_eviction``), or
one node that node steering empties so an autoscaler can remove it
(``controller.node_eviction``). Both go through this one engine, so both keep the same rules.

For each place steered at least ``after_s``, longest-steered first: the place's holders now
(the claims allocated its devices), each holder's pod (the pod its claim was generated for)
and what may be done (``driver.allocation.consolidation``); then at most ``max_in_flight``
pods at a time are evicted through the Eviction API (``controller.pod_eviction``), so
PodDisruptionBudgets are honoured: a 429 means a budget allows no disruption now, and the pod
is tried again later. A budget that selects a pod is also its owner's consent to its moving;
the budgets come from a watch (``controller.disruption_budgets``), and nothing is decided
before it has listed them.

A place's holders are evicted only when every holder may move and every moving pod's claims
fit elsewhere now (``driver.allocation.relocation``): outside the GPUs being cleared and the
nodes being steered, one pod after another. The snapshot's devices carry only the taints
their slices publish (DeviceTaintRules are not watched), so flexgpu's own steered devices are
held off explicitly. Where one holder must stay, or one has nowhere to go, nobody there is
evicted and one Event names it. Any answer of the Eviction API other than the handled ones
counts as a refusal of that pod: an Event, the pod asked again after ``BLOCKED_RETRY_S``, and
the pass goes on.

The cache holds only pods that wait for a node, so the holders' pods are read from the API
server, only for places past the bound (a few reads per pass). A pod is in flight from its
eviction until a read finds it gone. Pods holding such a place that are being deleted count
too, whoever deleted them: a new leader does not know what the old one evicted, and counting
every ending pod keeps the bound. Each engine keeps its own bound. A read that fails (an error
status, a broken connection) leaves that place for a later pass; the pass goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Final

from kubernetes import client
from prometheus_client import Counter, Gauge
from urllib3.exceptions import HTTPError

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.events import EventTarget
from flexgpu.controller.pod_eviction import (
    BudgetReader,
    EvictionSink,
    PodEvictor,
    PodReader,
    read_holder,
)
from flexgpu.controller.pod_nodes import node_fit
from flexgpu.controller.records import CachedClaim, PodRecord
from flexgpu.driver.allocation.clearing import gpus_on_node
from flexgpu.driver.allocation.consolidation import GpuPlan, HolderPod, choose, consent, plan_gpu
from flexgpu.driver.allocation.relocation import MovingPod, Stranded, stranded
from flexgpu.driver.allocation.selectors import SelectorCache
from flexgpu.driver.allocation.state import AllocatedState, DeviceId, allocated_state
from flexgpu.driver.durations import human_duration
from flexgpu.driver.names import DRIVER_NAME

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT: Final = 1
# A pod a PodDisruptionBudget kept (or the server refused) is asked for again after this
# long, not every pass.
BLOCKED_RETRY_S: Final = 30.0
# Pods are read at most this often: a busy cluster changes the snapshot every second, and a
# place steered for minutes loses nothing by a few seconds more.
READ_INTERVAL_S: Final = 10.0
# A pod read that failed (an error status, a broken connection): that place waits a pass.
READ_ERRORS: Final = (client.ApiException, HTTPError, OSError)


@dataclass(frozen=True)
class Place:
    """A place being emptied by eviction: one GPU or one whole node."""

    key: str  # what was already said is remembered by it (a claim uid, a node name)
    node: str
    # The GPU as node/pool/uuid; None: the whole node, every flexgpu device on it.
    gpu: str | None
    since: float  # the engine's clock
    purpose: str  # why it is emptied, after its name: "for claim ns/name"
    told: EventTarget  # what a waiting or refusal Event goes to (the claim; the node)

    @property
    def words(self) -> str:
        return f"GPU {self.gpu}" if self.gpu is not None else f"node {self.node}"


@dataclass(frozen=True)
class Said:
    """How one engine speaks: its Event reasons and its metrics."""

    evicted: str
    blocked: str
    refused: str
    waits: str
    evictions: Counter  # by outcome: evicted, blocked, gone, refused
    in_flight: Gauge


@dataclass(frozen=True)
class _Planned:
    place: Place
    plan: GpuPlan
    stranded: Stranded | None = None  # a pod that would have nowhere to go: none evicted


class PlaceEvictions:
    def __init__(
        self,
        pods: PodReader,
        evictor: PodEvictor,
        sink: EvictionSink,
        budgets: BudgetReader,
        *,
        what: str,
        said: Said,
        after_s: float,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``what``: the feature's name in errors ("clearing eviction")."""
        if after_s <= 0:
            raise ValueError(f"{what} after {after_s}s: must be more than 0 seconds")
        if max_in_flight < 1:
            raise ValueError(f"{what} maxInFlight {max_in_flight}: must be 1 or more")
        self._pods = pods
        self._evictor = evictor
        self._sink = sink
        self._budgets = budgets
        self._said = said
        self._after_s = after_s
        self._max_in_flight = max_in_flight
        self._clock = clock
        self._evicted: dict[str, tuple[str, str]] = {}  # pod uid -> (namespace, name) till gone
        self._blocked: dict[str, float] = {}  # pod uid -> when a budget last kept it
        self._told: set[tuple[str, str]] = set()  # (place key, message) already said
        self._read_at = -READ_INTERVAL_S  # when pods were last read (clock)

    @property
    def after_s(self) -> float:
        return self._after_s

    def forget(self) -> None:
        self._evicted.clear()
        self._blocked.clear()
        self._told.clear()
        self._read_at = -READ_INTERVAL_S
        self._said.in_flight.set(0)

    def run(
        self,
        snapshot: Snapshot,
        places: Sequence[Place],
        *,
        cleared_gpus: Collection[str],
        steered_nodes: Collection[str],
    ) -> None:
        """``places``: what this engine empties, each still serving its purpose;
        ``cleared_gpus`` (node/pool/uuid) and ``steered_nodes``: where flexgpu keeps new
        claims off, so no room for a moved pod."""
        now = self._clock()
        due = sorted(
            (p for p in places if now - p.since >= self._after_s), key=lambda p: (p.since, p.key)
        )
        if not (due or self._evicted) or now - self._read_at < READ_INTERVAL_S:
            return
        if not self._budgets.synced():
            return  # a pod a budget selects would be taken for one that did not consent
        self._read_at = now
        self._blocked = {u: t for u, t in self._blocked.items() if now - t < BLOCKED_RETRY_S}
        for uid, (namespace, name) in list(self._evicted.items()):
            try:
                current = self._pods.read(namespace, name)
            except READ_ERRORS as err:
                log.info("reading evicted pod %s/%s: %s", namespace, name, err)
                continue  # still counted in flight: the bound holds while the server is away
            if current is None or current.uid != uid:
                del self._evicted[uid]
        planned: list[_Planned] = []
        if due:
            state = allocated_state(snapshot.claim_models)
            room = _Room(snapshot, cleared_gpus, steered_nodes)
            planned = [p for place in due if (p := self._plan(snapshot, state, room, place))]
        # Being deleted counts as in flight; a finished pod whose claim is still held does not.
        ending = {p.uid for g in planned for p in g.plan.ending if p.deleting}
        in_flight = len(ending | set(self._evicted))
        for item in planned:
            self._tell_waits(item)
        skip = set(self._evicted) | set(self._blocked)
        plans = [(item.place, _without(item.plan, skip)) for item in planned]
        for place, pod in choose(plans, in_flight, self._max_in_flight):
            self._evict(place, pod, now)
        self._said.in_flight.set(len(ending | set(self._evicted)))

    def _plan(
        self, snapshot: Snapshot, state: AllocatedState, room: _Room, place: Place
    ) -> _Planned | None:
        devices = room.devices(place)
        if devices is None:
            return None  # not published any more: its steering ends on its own
        keys = sorted({h for d in devices for h in state.holders.get(d, ())})
        try:
            read = [
                read_holder(snapshot.claims[k], self._pods, self._budgets)
                for k in keys
                if k in snapshot.claims
            ]
        except READ_ERRORS as err:
            # This place waits for a later pass; the other places and the rest of the
            # controller's pass go on.
            log.info("reading the pods holding %s: %s", place.words, err)
            return None
        plan = plan_gpu([h for h, _ in read])
        if plan.evict:
            records = {p.uid: p for _, p in read if p is not None}
            moving = [room.moving(records[p.uid]) for p in plan.evict]
            nowhere = room.stranded(moving)
            if nowhere is not None:  # all or nothing: moving the others would not empty it
                return _Planned(place, _without(plan, {p.uid for p in plan.evict}), nowhere)
        return _Planned(place, plan)

    def _tell_waits(self, item: _Planned) -> None:
        """Says once, on the place's told object, which holders keep the place and why, or
        which holder's claim would have nowhere to go."""
        place = item.place
        if item.plan.waits_for:
            reasons = "; ".join(why for _, why in item.plan.waits_for)
            why = f"it waits for these holders to end: {reasons}"
        elif item.stranded is not None:
            why = (
                f"pod {item.stranded.pod} would have nowhere to go now ({item.stranded.why}); "
                "it asks again as the cluster changes"
            )
        else:
            return
        # No running time in the words: the same holders are said once, not once a pass.
        message = (
            f"flexgpu evicts nobody from {place.words} {place.purpose}, steered longer than "
            f"{human_duration(self._after_s)}: {why}"
        )
        if (place.key, message) in self._told:
            return
        self._told.add((place.key, message))
        log.info("%s", message)
        self._sink.emit(place.told, self._said.waits, message, repeat=False, event_type="Normal")

    def _evict(self, place: Place, pod: HolderPod, now: float) -> None:
        said = self._said
        outcome, detail = self._evictor.evict(pod.namespace, pod.name, pod.uid)
        said.evictions.labels(outcome).inc()
        pod_target = EventTarget("Pod", "v1", pod.namespace, pod.name, pod.uid)
        node_target = EventTarget("Node", "v1", "", place.node, "")
        where = f"{place.words} {place.purpose}"
        if outcome == "evicted":
            self._evicted[pod.uid] = (pod.namespace, pod.name)
            kind = "GPU" if place.gpu is not None else "node"
            message = (
                f"flexgpu evicted pod {pod.key}, emptying {where} (steered for "
                f"{human_duration(now - place.since)}): its owner consented ({consent(pod)}) "
                f"and its {pod.controller.partition('.')[0]} makes it again; the {kind}'s new "
                "claims are kept elsewhere"
            )
            log.info("%s", message)
            for target in _distinct(pod_target, node_target, place.told):
                self._sink.emit(target, said.evicted, message, repeat=False, event_type="Normal")
        elif outcome == "blocked":
            self._blocked[pod.uid] = now
            message = (
                f"flexgpu may not evict pod {pod.key} from {where} now: "
                f"{detail or 'a PodDisruptionBudget allows no disruption'}; it asks again in "
                f"{BLOCKED_RETRY_S:.0f}s"
            )
            log.info("%s", message)
            self._sink.emit(pod_target, said.blocked, message, repeat=True, event_type="Normal")
        elif outcome == "refused":
            self._blocked[pod.uid] = now
            message = (
                f"flexgpu could not evict pod {pod.key} from {where}: the API server refused "
                f"({detail}); it asks again in {BLOCKED_RETRY_S:.0f}s"
            )
            log.warning("%s", message)
            for target in _distinct(pod_target, place.told):
                self._sink.emit(target, said.refused, message, repeat=True)
        else:
            log.info("pod %s left before its eviction: %s", pod.key, detail)


class _Room:
    """The places' devices, and where their holders could go, over one pass's snapshot."""

    def __init__(
        self, snapshot: Snapshot, cleared_gpus: Collection[str], steered_nodes: Collection[str]
    ) -> None:
        self._snapshot = snapshot
        self._gpus = {
            f"{g.node}/{g.pool}/{g.uuid}": g
            for record in snapshot.nodes.values()
            for g in gpus_on_node(record.model, snapshot.slice_index)
        }
        # Every GPU being cleared and every GPU of a steered node (the place the pods leave
        # among them): flexgpu's taints keep new claims off them.
        nodes, cleared = set(steered_nodes), set(cleared_gpus)
        self._held_off: tuple[DeviceId, ...] = tuple(
            d
            for text, g in self._gpus.items()
            if g.node in nodes or text in cleared
            for d in g.devices
        )
        self._generated: dict[str, list[CachedClaim]] = {}
        for claim in snapshot.claims.values():
            if claim.owner_pod is not None and claim.allocated:
                self._generated.setdefault(claim.owner_pod[1], []).append(claim)
        self._selectors = SelectorCache()

    def devices(self, place: Place) -> tuple[DeviceId, ...] | None:
        """The devices whose holders must move, as the slices show them now; None when the
        place publishes none."""
        if place.gpu is not None:
            gpu = self._gpus.get(place.gpu)
            return gpu.devices if gpu is not None else None
        record = self._snapshot.nodes.get(place.node)
        if record is None:
            return None
        # Every flexgpu device of the node, not only those that name a GPU: a claim on any
        # of them keeps the node.
        found = tuple(
            (pool.driver, pool.name, device.name)
            for pool in self._snapshot.slice_index.pools(record.model)
            if pool.driver == DRIVER_NAME
            for slc in pool.device_slices
            for device in slc.devices
        )
        return found or None

    def moving(self, pod: PodRecord) -> MovingPod:
        claims = sorted(self._generated.get(pod.uid, ()), key=lambda c: c.model.key)
        usable = node_fit(pod, self._snapshot.nodes.values()).usable
        return MovingPod(pod.key, tuple(c.model for c in claims), usable)

    def stranded(self, moving: list[MovingPod]) -> Stranded | None:
        snapshot = self._snapshot
        return stranded(
            moving,
            slices=snapshot.slice_list,
            classes=snapshot.classes,
            claims=snapshot.claim_models,
            nodes=snapshot.node_models,
            held_off=self._held_off,
            selectors=self._selectors,
        )


def _without(plan: GpuPlan, skip: set[str]) -> GpuPlan:
    return GpuPlan(
        evict=tuple(p for p in plan.evict if p.uid not in skip),
        ending=plan.ending,
        waits_for=plan.waits_for,
    )


def _distinct(*targets: EventTarget) -> list[EventTarget]:
    return list(dict.fromkeys(targets))
