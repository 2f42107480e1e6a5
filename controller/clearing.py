"""Clearing GPUs for claims that wait on fragmented capacity, without moving anyone.

Each pass (leader only, ``controller.active``):

1. ends steering whose claim was allocated ("placed"), deleted or no longer waited for by a
   pod ("gone"), or that has run longer than ``max_s`` ("timed out": that claim is not
   steered for again until as long again has passed): its DeviceTaintRules are deleted;
2. for pending claims (``controller.pending``) the evaluator cannot place, oldest pod first,
   while fewer than ``share`` of the cluster's GPUs are steered: picks the GPU that would take
   the claim once its holders end (``driver.allocation.clearing``) and taints that GPU's other
   devices NoSchedule under ``flexgpu.dev/clearing`` (``controller.taint_rules``), so new
   claims go elsewhere while the holders finish;
3. with eviction on (``controller.clearing_eviction``), between the two: evicts the pods that
   opted in from GPUs steered longer than its bound, a few at a time, when each has room
   elsewhere now (off the GPUs being cleared and the nodes being steered).

The waiting claim needs no toleration: the devices it would take are left untainted. Rules
outlive the process; a new leader lists them at its first pass and takes them over, so a
restart neither leaks rules nor steers twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, Protocol

from prometheus_client import Counter, Gauge

from flexgpu.controller.clearing_eviction import Evictions
from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.evaluation import Memo, evaluate
from flexgpu.controller.events import EventTarget
from flexgpu.controller.pending import PendingClaim, pending_claims
from flexgpu.controller.records import CachedClaim
from flexgpu.controller.taint_rules import ClearingFor, RuleInfo
from flexgpu.driver.allocation.clearing import (
    Candidate,
    ClearingInputs,
    candidates,
    count_gpus,
    steering_limit,
)
from flexgpu.driver.allocation.state import DeviceId
from flexgpu.driver.durations import human_duration

log = logging.getLogger(__name__)

STARTED: Final = "GpuClearing"
ENDED: Final = "GpuClearingEnded"
DEFAULT_SHARE: Final = 0.1
DEFAULT_MAX_S: Final = 3600.0
RECHECK_S: Final = 10.0

STEERED_GPUS: Final = Gauge(
    "flexgpu_clearing_gpus",
    "GPUs new claims are kept off so that they empty for a waiting claim (leader only)",
)
STEERED_DEVICES: Final = Gauge(
    "flexgpu_clearing_gpu_info",
    "1 for each GPU being cleared, naming it and the claim it is cleared for",
    ["node", "pool", "gpu", "claim"],
)
CLEARING_STARTED: Final = Counter(
    "flexgpu_clearing_started", "GPUs the leader started clearing for a waiting claim"
)
CLEARING_ENDED: Final = Counter(
    "flexgpu_clearing_ended",
    "GPU clearings ended, by outcome (placed, gone, timed_out)",
    ["outcome"],
)


def clearing_inputs(snapshot: Snapshot, wall: datetime) -> ClearingInputs:
    """What the choice of a GPU is made over, from the controller's snapshot at ``wall``."""
    return ClearingInputs(
        slices=snapshot.slice_list,
        classes=snapshot.classes,
        claims=snapshot.claim_models,
        nodes=snapshot.node_models,
        holder_ages={
            c.model.key: (wall - c.allocated_at).total_seconds()
            for c in snapshot.claims.values()
            if c.allocated_at is not None
        },
        index=snapshot.slice_index,
    )


class RuleStore(Protocol):
    def version(self) -> str | None: ...
    def list(self) -> list[RuleInfo]: ...
    def create(self, what: ClearingFor, device: DeviceId) -> str: ...
    def delete(self, name: str) -> None: ...


class ClearingSink(Protocol):
    def emit(
        self,
        target: EventTarget,
        reason: str,
        message: str,
        *,
        repeat: bool,
        event_type: str = "Warning",
    ) -> None: ...


@dataclass
class Steering:
    """One GPU being cleared for one waiting claim."""

    claim_uid: str
    claim: str  # namespace/name
    gpu: str  # node/pool/uuid
    since: float  # this process's clock
    rules: list[str] = field(default_factory=list)
    targets: tuple[EventTarget, ...] = ()  # the pod and claim (and node) told when it ends


def _gpu_text(candidate: Candidate) -> str:
    gpu = candidate.gpu
    return f"{gpu.node}/{gpu.pool}/{gpu.uuid}"


def since_wall(text: str, wall: datetime, now: float) -> float:
    """A rule's start time on this process's clock (a rule without one starts now)."""
    try:
        started = datetime.fromisoformat(text)
    except ValueError:
        return now
    if started.tzinfo is None:
        started = started.replace(tzinfo=UTC)
    return now - max(0.0, (wall - started).total_seconds())


def _adopted_targets(steering: Steering, claim: CachedClaim | None) -> tuple[EventTarget, ...]:
    node = EventTarget("Node", "v1", "", steering.gpu.partition("/")[0], "")
    if claim is None:
        return (node,)
    model = claim.model
    return (
        EventTarget("ResourceClaim", "resource.k8s.io/v1", model.namespace, model.name, model.uid),
        node,
    )


class Clearing:
    def __init__(
        self,
        rules: RuleStore,
        sink: ClearingSink,
        *,
        delay_s: float,
        share: float = DEFAULT_SHARE,
        max_s: float = DEFAULT_MAX_S,
        evictions: Evictions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        steering_limit(1, share)  # validates share
        if max_s <= 0:
            raise ValueError(f"clearing max duration {max_s}: must be more than 0 seconds")
        if evictions is not None and evictions.after_s >= max_s:
            # Steering would end before eviction is ever considered.
            raise ValueError(
                f"clearing eviction after {evictions.after_s:.0f}s: must be less than the "
                f"clearing max duration ({max_s:.0f}s)"
            )
        self._evictions = evictions
        self._rules = rules
        self._sink = sink
        self._delay_s = delay_s
        self._share = share
        self._max_s = max_s
        self._clock = clock
        self._active: dict[str, Steering] = {}  # claim uid -> steering
        self._gave_up: dict[str, float] = {}  # claim uid -> when its steering timed out
        self._adopted = False
        self._last: tuple[int, float] | None = None  # (snapshot revision, clock) of last pass

    @property
    def active(self) -> Mapping[str, Steering]:
        return self._active

    def forget(self) -> None:
        """Lost the lease: the rules stay for the next leader to take over."""
        self._active.clear()
        self._gave_up.clear()
        self._adopted = False
        self._last = None
        if self._evictions is not None:
            self._evictions.forget()
        STEERED_GPUS.set(0)
        STEERED_DEVICES.clear()

    def _adopt(self, wall: datetime) -> None:
        now = self._clock()
        for info in self._rules.list():
            steering = self._active.get(info.claim_uid)
            if steering is None:
                steering = Steering(
                    info.claim_uid, info.claim, info.gpu, since_wall(info.since, wall, now)
                )
                self._active[info.claim_uid] = steering
            steering.rules.append(info.name)
        self._adopted = True

    def run_pass(
        self, snapshot: Snapshot, wall: datetime, steered_nodes: Iterable[str] = ()
    ) -> None:
        """``steered_nodes``: the nodes node steering keeps new claims off, where eviction
        does not count on room for a moved pod."""
        if self._rules.version() is None:
            return
        now = self._clock()
        # Nothing changed since the last pass: only the time bound can have moved, and a
        # second's lateness on it matters less than a core busy with the same search.
        last = self._last
        if last is not None and last[0] == snapshot.revision and now - last[1] < RECHECK_S:
            return
        self._last = (snapshot.revision, now)
        if not self._adopted:
            self._adopt(wall)
        pending = list(pending_claims(snapshot, wall, self._delay_s))
        self._end_finished(snapshot, pending)
        if self._evictions is not None:
            self._evictions.run(snapshot, list(self._active.values()), steered_nodes)
        self._start_new(snapshot, pending, wall)
        self._export()

    # --- ending ------------------------------------------------------------------------------

    def _end_finished(self, snapshot: Snapshot, pending: list[PendingClaim]) -> None:
        now = self._clock()
        by_uid = {c.model.uid: c for c in snapshot.claims.values()}
        waited_for = {p.claim.model.uid for p in pending}
        # A pod younger than the pending delay still waits: only a claim no pod waits for at
        # all is gone.
        waiting = {
            c.model.uid
            for pod in snapshot.pods.values()
            if not pod.node_name and not pod.deleting
            for key in pod.claim_keys()
            if (c := snapshot.claims.get(key)) is not None
        }
        for uid, steering in list(self._active.items()):
            claim = by_uid.get(uid)
            if claim is not None and claim.allocated:
                outcome = "placed"
            elif claim is None or (uid not in waited_for and uid not in waiting):
                outcome = "gone"
            elif now - steering.since >= self._max_s:
                outcome = "timed_out"
                self._gave_up[uid] = now
            else:
                continue
            if not steering.targets:  # taken over from another leader: tell what is known
                steering.targets = _adopted_targets(steering, claim)
            self._end(steering, outcome)
        for uid, at in list(self._gave_up.items()):
            if now - at >= self._max_s:
                del self._gave_up[uid]

    def _end(self, steering: Steering, outcome: str) -> None:
        for name in list(steering.rules):
            self._rules.delete(name)
            steering.rules.remove(name)
        del self._active[steering.claim_uid]
        CLEARING_ENDED.labels(outcome).inc()
        words = {
            "placed": "the claim was allocated",
            "gone": "no pod waits for the claim any more",
            "timed_out": f"it did not empty within {self._max_s:.0f}s",
        }[outcome]
        message = (
            f"flexgpu no longer keeps new claims off GPU {steering.gpu} for claim "
            f"{steering.claim}: {words}"
        )
        log.info("%s", message)
        for target in steering.targets:
            self._sink.emit(target, ENDED, message, repeat=False, event_type="Normal")

    # --- starting ----------------------------------------------------------------------------

    def _start_new(self, snapshot: Snapshot, pending: list[PendingClaim], wall: datetime) -> None:
        gpus = count_gpus(snapshot.node_models, snapshot.slice_index)
        limit = steering_limit(gpus, self._share)
        log.debug("clearing: %d steered of at most %d (%d GPUs)", len(self._active), limit, gpus)
        if len(self._active) >= limit or not pending:
            return
        memo = Memo()
        inputs = clearing_inputs(snapshot, wall)
        for item in pending:
            if len(self._active) >= limit:
                return
            uid = item.claim.model.uid
            if uid in self._active or uid in self._gave_up or item.claim.extended_resources:
                continue
            evaluation = evaluate(snapshot, item.claim, item.pod, memo=memo)
            if evaluation.satisfiable:
                continue
            usable = evaluation.fit.usable if evaluation.fit is not None else None
            busy = {s.gpu for s in self._active.values()}
            found = [
                c for c in candidates(item.claim.model, inputs, usable) if _gpu_text(c) not in busy
            ]
            if found:
                self._start(item, found[0], wall)
            else:
                log.debug("clearing: no single GPU to clear for claim %s", item.claim.model.key)

    def _start(self, item: PendingClaim, candidate: Candidate, wall: datetime) -> None:
        model = item.claim.model
        claim = f"{model.namespace}/{model.name}"
        gpu = _gpu_text(candidate)
        since = wall.strftime("%Y-%m-%dT%H:%M:%SZ")
        pod, node = item.pod, candidate.gpu.node
        targets = (
            EventTarget("Pod", "v1", pod.namespace, pod.name, pod.uid),
            EventTarget(
                "ResourceClaim", "resource.k8s.io/v1", model.namespace, model.name, model.uid
            ),
            EventTarget("Node", "v1", "", node, ""),
        )
        steering = Steering(model.uid, claim, gpu, self._clock(), targets=targets)
        # Registered before the first rule is created: a failure halfway still ends in
        # _end, which deletes what was made.
        self._active[model.uid] = steering
        what = ClearingFor(model.uid, claim, gpu, since)
        for device in candidate.steer:
            steering.rules.append(self._rules.create(what, device))
        CLEARING_STARTED.inc()
        holders = ", ".join(candidate.holders)
        moved = "nobody is moved"
        if self._evictions is not None:
            moved = (
                f"after {human_duration(self._evictions.after_s)} the pods that opted in "
                "may be evicted"
            )
        message = (
            f"flexgpu keeps new claims off GPU {gpu} so that it empties for claim {claim}, "
            f"which waits for pod {pod.namespace}/{pod.name}: its {len(candidate.holders)} "
            f"holder(s) ({holders}) run on and {moved}"
        )
        log.info("%s", message)
        for target in targets:
            self._sink.emit(target, STARTED, message, repeat=False, event_type="Normal")

    def _export(self) -> None:
        STEERED_GPUS.set(len(self._active))
        STEERED_DEVICES.clear()
        for steering in self._active.values():
            node, _, rest = steering.gpu.partition("/")
            pool, _, gpu = rest.partition("/")
            STEERED_DEVICES.labels(node, pool, gpu, steering.claim).set(1)
