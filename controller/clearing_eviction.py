"""Evicting the pods that may move from a GPU that has been steered too long (leader only).

Called by ``controller.clearing`` after the pass has ended the steerings whose claim was
placed or gone, so eviction only ever serves a claim that still waits. For each steering
older than ``after_s``, oldest first: the GPU's holders now (from the claims' allocations),
each holder's pod (the pod its claim was generated for) and what may be done
(``driver.allocation.consolidation``); then at most ``max_in_flight`` pods at a time are
evicted through the Eviction API (policy/v1), so PodDisruptionBudgets are honoured: a 429
means a budget allows no disruption now, and the pod is tried again later. A budget that
selects a pod is also its owner's consent to its moving; the budgets come from a watch
(``controller.disruption_budgets``), and nothing is decided before it has listed them.

A GPU's holders are evicted only when every moving pod's claims fit elsewhere now
(``driver.allocation.relocation``): outside the GPUs being cleared and the nodes being
steered, one pod after another. The snapshot's devices carry only the taints their slices
publish (DeviceTaintRules are not watched), so flexgpu's own steered devices are held off
explicitly. Where one has nowhere to go, nobody on that GPU is evicted and the waits Event
names its claim. Any answer of the Eviction API other than the handled ones (a 500 for a pod
two budgets select, a 403) counts as a refusal of that pod: an Event on the pod and the
claim, the pod asked again after ``BLOCKED_RETRY_S``, and the pass goes on.

The cache holds only pods that wait for a node, so the holders' pods are read from the API
server, only for GPUs past the bound (a few reads per pass). A pod is in flight from its
eviction until a read finds it gone. Pods holding such a GPU that are being deleted count
too, whoever deleted them: a new leader does not know what the old one evicted, and counting
every ending pod keeps the bound.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kubernetes import client
from prometheus_client import Counter, Gauge

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.events import EventTarget
from flexgpu.controller.pod_nodes import node_fit
from flexgpu.controller.records import CachedClaim, PodRecord, pod_record
from flexgpu.driver.allocation.clearing import Gpu, gpus_on_node
from flexgpu.driver.allocation.consolidation import (
    GpuPlan,
    Holder,
    HolderPod,
    choose,
    consent,
    plan_gpu,
)
from flexgpu.driver.allocation.relocation import MovingPod, Stranded, stranded
from flexgpu.driver.allocation.selectors import SelectorCache
from flexgpu.driver.allocation.state import AllocatedState, DeviceId, allocated_state
from flexgpu.driver.durations import human_duration

log = logging.getLogger(__name__)

EVICTED: Final = "GpuClearingEviction"
BLOCKED: Final = "GpuClearingEvictionBlocked"
REFUSED: Final = "GpuClearingEvictionRefused"
WAITS: Final = "GpuClearingWaitsForPods"
DEFAULT_MAX_IN_FLIGHT: Final = 1
# A pod a PodDisruptionBudget kept (or the server refused) is asked for again after this
# long, not every pass.
BLOCKED_RETRY_S: Final = 30.0
# Pods are read at most this often: a busy cluster changes the snapshot every second, and a
# GPU steered for minutes loses nothing by a few seconds more.
READ_INTERVAL_S: Final = 10.0
HTTP_NOT_FOUND: Final = 404
HTTP_CONFLICT: Final = 409  # the uid precondition failed: the pod of that name is a new one
HTTP_TOO_MANY: Final = 429  # a PodDisruptionBudget allows no disruption now

EVICTIONS: Final = Counter(
    "flexgpu_clearing_evictions",
    "Eviction API calls GPU clearing made for pods that opted in, by outcome: evicted "
    "(accepted), blocked (HTTP 429: a PodDisruptionBudget allows no disruption now), gone "
    "(the pod was deleted or replaced before the call), refused (any other error status)",
    ["outcome"],
)
IN_FLIGHT: Final = Gauge(
    "flexgpu_clearing_evictions_in_flight",
    "Pods holding a GPU being cleared that are being deleted (evicted by the leader or "
    "deleted by anyone), as the leader's cache shows them",
)


class SteeredGpu(Protocol):
    """What eviction reads of a steering (``controller.clearing.Steering``)."""

    claim_uid: str
    claim: str  # namespace/name
    gpu: str  # node/pool/uuid
    since: float  # the clearing's clock


class PodReader(Protocol):
    def read(self, namespace: str, name: str) -> PodRecord | None:
        """The pod as the server has it now; None when there is none."""
        ...


class BudgetReader(Protocol):
    """The PodDisruptionBudgets (``controller.disruption_budgets.Budgets``)."""

    def synced(self) -> bool: ...

    def selecting(self, namespace: str, labels: Mapping[str, str]) -> tuple[str, ...]:
        """The names of the budgets of ``namespace`` that select a pod with ``labels``."""
        ...


class PodEvictor(Protocol):
    def evict(self, namespace: str, name: str, uid: str) -> tuple[str, str]:
        """(outcome, detail): outcome is evicted, blocked, gone or refused; detail the
        server's words."""
        ...


class EvictionSink(Protocol):
    def emit(
        self,
        target: EventTarget,
        reason: str,
        message: str,
        *,
        repeat: bool,
        event_type: str = "Warning",
    ) -> None: ...


class ApiPods:
    """Reads pods, and evicts them through the pods/eviction subresource (policy/v1)."""

    def __init__(self, api: client.ApiClient) -> None:
        self._core = client.CoreV1Api(api)

    def read(self, namespace: str, name: str) -> PodRecord | None:
        try:
            response: Any = self._core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=10
            )
        except client.ApiException as err:
            if err.status == HTTP_NOT_FOUND:
                return None
            raise
        return pod_record(json.loads(response.data))

    def evict(self, namespace: str, name: str, uid: str) -> tuple[str, str]:
        body = client.V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            # The uid precondition: a StatefulSet's new pod of the same name is not the one
            # that was decided on.
            delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
        )
        try:
            self._core.create_namespaced_pod_eviction(name, namespace, body, _request_timeout=10)
        except client.ApiException as err:
            if err.status == HTTP_TOO_MANY:
                return "blocked", _reason(err)
            if err.status in (HTTP_NOT_FOUND, HTTP_CONFLICT):
                return "gone", _reason(err)
            # Anything else (a 500 for a pod two budgets select, a 403) is this pod's
            # answer, not the pass's: raising would end every pass while the pod exists.
            return "refused", f"HTTP {err.status}: {_reason(err)}"
        return "evicted", ""


def _reason(err: client.ApiException) -> str:
    try:
        return str(json.loads(err.body or "{}").get("message") or err.reason)
    except ValueError:
        return str(err.reason)


def _holder(
    claim: CachedClaim, pods: PodReader, budgets: BudgetReader
) -> tuple[Holder, PodRecord | None]:
    key = claim.model.key
    if claim.owner_pod is None:
        return Holder(key, None, generated=False), None
    name, uid = claim.owner_pod
    pod = pods.read(claim.model.namespace, name)
    if pod is None or pod.uid != uid:  # gone (a pod of the same name is another one)
        return Holder(key, None), None
    holder = Holder(
        key,
        HolderPod(
            pod.namespace,
            pod.name,
            pod.uid,
            pod.movable,
            pod.controller,
            ending=pod.deleting or pod.phase in ("Succeeded", "Failed"),
            deleting=pod.deleting,
            budgets=budgets.selecting(pod.namespace, pod.labels),
        ),
    )
    return holder, pod


@dataclass(frozen=True)
class _Gpu:
    steering: SteeredGpu
    node: str
    plan: GpuPlan
    stranded: Stranded | None = None  # a pod that would have nowhere to go: none evicted


class Evictions:
    def __init__(
        self,
        pods: PodReader,
        evictor: PodEvictor,
        sink: EvictionSink,
        budgets: BudgetReader,
        *,
        after_s: float,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if after_s <= 0:
            raise ValueError(f"clearing eviction after {after_s}s: must be more than 0 seconds")
        if max_in_flight < 1:
            raise ValueError(f"clearing eviction maxInFlight {max_in_flight}: must be 1 or more")
        self._pods = pods
        self._evictor = evictor
        self._sink = sink
        self._budgets = budgets
        self._after_s = after_s
        self._max_in_flight = max_in_flight
        self._clock = clock
        self._evicted: dict[str, tuple[str, str]] = {}  # pod uid -> (namespace, name) till gone
        self._blocked: dict[str, float] = {}  # pod uid -> when a budget last kept it
        self._told: set[tuple[str, str]] = set()  # (claim uid, message) already said
        self._read_at = -READ_INTERVAL_S  # when pods were last read (clock)

    @property
    def after_s(self) -> float:
        return self._after_s

    def forget(self) -> None:
        self._evicted.clear()
        self._blocked.clear()
        self._told.clear()
        self._read_at = -READ_INTERVAL_S
        IN_FLIGHT.set(0)

    def run(
        self,
        snapshot: Snapshot,
        steerings: Iterable[SteeredGpu],
        steered_nodes: Iterable[str] = (),
    ) -> None:
        """``steerings``: every GPU being cleared; ``steered_nodes``: the nodes node steering
        keeps new claims off. A moved pod is counted on neither."""
        steerings = list(steerings)
        now = self._clock()
        by_uid = {c.model.uid: c for c in snapshot.claims.values()}
        due = [
            s
            for s in sorted(steerings, key=lambda s: (s.since, s.claim))
            if now - s.since >= self._after_s
            # Placed or gone: nothing is evicted for it (the pass ends such steering first;
            # this holds whatever the caller did).
            and (waiting := by_uid.get(s.claim_uid)) is not None
            and not waiting.allocated
        ]
        if not (due or self._evicted) or now - self._read_at < READ_INTERVAL_S:
            return
        if not self._budgets.synced():
            return  # a pod a budget selects would be taken for one that did not consent
        self._read_at = now
        self._blocked = {u: t for u, t in self._blocked.items() if now - t < BLOCKED_RETRY_S}
        for uid, (namespace, name) in list(self._evicted.items()):
            current = self._pods.read(namespace, name)
            if current is None or current.uid != uid:
                del self._evicted[uid]
        gpus: list[_Gpu] = []
        if due:
            state = allocated_state(snapshot.claim_models)
            places = _Places(snapshot, steerings, steered_nodes)
            gpus = [g for s in due if (g := self._plan(snapshot, state, places, s)) is not None]
        # Being deleted counts as in flight; a finished pod whose claim is still held does not.
        ending = {p.uid for g in gpus for p in g.plan.ending if p.deleting}
        in_flight = len(ending | set(self._evicted))
        for gpu in gpus:
            self._tell_waits(gpu)
        skip = set(self._evicted) | set(self._blocked)
        plans = [(gpu, _without(gpu.plan, skip)) for gpu in gpus]
        for gpu, pod in choose(plans, in_flight, self._max_in_flight):
            self._evict(gpu, pod, now)
        IN_FLIGHT.set(len(ending | set(self._evicted)))

    def _plan(
        self, snapshot: Snapshot, state: AllocatedState, places: _Places, steering: SteeredGpu
    ) -> _Gpu | None:
        gpu = places.gpu(steering.gpu)
        if gpu is None:
            return None
        keys = sorted({h for d in gpu.devices for h in state.holders.get(d, ())})
        read = [
            _holder(snapshot.claims[k], self._pods, self._budgets)
            for k in keys
            if k in snapshot.claims
        ]
        plan = plan_gpu([h for h, _ in read])
        if plan.evict:
            records = {p.uid: p for _, p in read if p is not None}
            moving = [places.moving(records[p.uid]) for p in plan.evict]
            nowhere = places.stranded(moving)
            if nowhere is not None:  # all or nothing: moving the others would not empty it
                return _Gpu(
                    steering, gpu.node, _without(plan, {p.uid for p in plan.evict}), nowhere
                )
        return _Gpu(steering, gpu.node, plan)

    def _tell_waits(self, gpu: _Gpu) -> None:
        """Says once, on the waiting claim, which holders keep the GPU and why, or which
        holder's claim would have nowhere to go."""
        steering = gpu.steering
        if gpu.plan.waits_for:
            reasons = "; ".join(why for _, why in gpu.plan.waits_for)
            why = f"it waits for these holders to end: {reasons}"
        elif gpu.stranded is not None:
            why = (
                f"pod {gpu.stranded.pod} would have nowhere to go now ({gpu.stranded.why}); it "
                "asks again as the cluster changes"
            )
        else:
            return
        # No running time in the words: the same holders are said once, not once a pass.
        message = (
            f"flexgpu evicts nobody from GPU {steering.gpu} for claim {steering.claim}, steered "
            f"longer than {human_duration(self._after_s)}: {why}"
        )
        if (steering.claim_uid, message) in self._told:
            return
        self._told.add((steering.claim_uid, message))
        log.info("%s", message)
        self._sink.emit(_claim_target(steering), WAITS, message, repeat=False, event_type="Normal")

    def _evict(self, gpu: _Gpu, pod: HolderPod, now: float) -> None:
        steering = gpu.steering
        outcome, detail = self._evictor.evict(pod.namespace, pod.name, pod.uid)
        EVICTIONS.labels(outcome).inc()
        pod_target = EventTarget("Pod", "v1", pod.namespace, pod.name, pod.uid)
        node_target = EventTarget("Node", "v1", "", gpu.node, "")
        waited = human_duration(now - steering.since)
        if outcome == "evicted":
            self._evicted[pod.uid] = (pod.namespace, pod.name)
            message = (
                f"flexgpu evicted pod {pod.key} from GPU {steering.gpu} so that it empties for "
                f"claim {steering.claim}, steered for {waited}: its owner consented "
                f"({consent(pod)}) and its {pod.controller.partition('.')[0]} makes it again; "
                "the GPU's new claims are kept elsewhere"
            )
            log.info("%s", message)
            for target in (pod_target, node_target, _claim_target(steering)):
                self._sink.emit(target, EVICTED, message, repeat=False, event_type="Normal")
        elif outcome == "blocked":
            self._blocked[pod.uid] = now
            message = (
                f"flexgpu may not evict pod {pod.key} from GPU {steering.gpu} for claim "
                f"{steering.claim} now: {detail or 'a PodDisruptionBudget allows no disruption'}"
                f"; it asks again in {BLOCKED_RETRY_S:.0f}s"
            )
            log.info("%s", message)
            self._sink.emit(pod_target, BLOCKED, message, repeat=True, event_type="Normal")
        elif outcome == "refused":
            self._blocked[pod.uid] = now
            message = (
                f"flexgpu could not evict pod {pod.key} from GPU {steering.gpu} for claim "
                f"{steering.claim}: the API server refused ({detail}); it asks again in "
                f"{BLOCKED_RETRY_S:.0f}s"
            )
            log.warning("%s", message)
            for target in (pod_target, _claim_target(steering)):
                self._sink.emit(target, REFUSED, message, repeat=True)
        else:
            log.info("pod %s left before its eviction: %s", pod.key, detail)


class _Places:
    """Where the holders of a GPU could go, over one pass's snapshot."""

    def __init__(
        self, snapshot: Snapshot, steerings: Iterable[SteeredGpu], steered_nodes: Iterable[str]
    ) -> None:
        self._snapshot = snapshot
        self._gpus = {
            f"{g.node}/{g.pool}/{g.uuid}": g
            for record in snapshot.nodes.values()
            for g in gpus_on_node(record.model, snapshot.slice_index)
        }
        # Every GPU being cleared (the one the pods leave included) and every GPU of a
        # steered node: flexgpu's taints keep new claims off them.
        nodes, cleared = set(steered_nodes), {s.gpu for s in steerings}
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

    def gpu(self, text: str) -> Gpu | None:
        """The GPU named node/pool/uuid, as the slices show it now."""
        return self._gpus.get(text)

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


def _claim_target(steering: SteeredGpu) -> EventTarget:
    namespace, _, name = steering.claim.partition("/")
    return EventTarget("ResourceClaim", "resource.k8s.io/v1", namespace, name, steering.claim_uid)
