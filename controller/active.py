"""The leader's work, one pass per tick: diagnostics for pending claims, Events for pods held
by flexgpu's binding conditions, pool metrics, the controller's part of GpuNodePolicy
status, and where turned on GPU clearing and node steering.

Every replica keeps the cache warm (the watches run everywhere), so a replica that becomes
leader acts at its next tick instead of after a full re-list. A pass starts only while the
lease is held and the cache has synced; losing the lease stops the work before the next write
and drops what the pass tracked, so the new leader alone decides what to say.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final

from kubernetes import client

from flexgpu.controller import metrics, policy_status
from flexgpu.controller.binding_waits import BindingWaits
from flexgpu.controller.clearing import Clearing
from flexgpu.controller.cluster_state import ClusterState
from flexgpu.controller.diagnostics import Diagnostics
from flexgpu.controller.node_steering import NodeSteering
from flexgpu.controller.taint_rule_sweep import LeftoverRules
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.loop import Loop

log = logging.getLogger(__name__)

TICK_S: Final = 1.0


class ActiveWork:
    def __init__(
        self,
        state: ClusterState,
        diagnostics: Diagnostics,
        api: client.ApiClient,
        is_leader: Callable[[], bool],
        *,
        binding_waits: BindingWaits | None = None,
        clearing: Clearing | None = None,
        node_steering: NodeSteering | None = None,
        leftover_rules: LeftoverRules | None = None,
        tick_s: float = TICK_S,
    ) -> None:
        self._state = state
        self._diagnostics = diagnostics
        self._binding_waits = binding_waits
        self._clearing = clearing
        self._node_steering = node_steering
        self._leftover_rules = leftover_rules
        self._api = api
        self._is_leader = is_leader
        self._pending_clock = metrics.PendingClock()
        self._was_leader = False
        # A failed pass is retried after a jittered delay; the next starts from a fresh snapshot.
        self._loop = Loop(
            "active-work", self.tick, tick_s, backoff=Backoff(tick_s, 10.0), first_run_s=tick_s
        )
        self.passes = 0

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout_s=30)

    def _demote(self) -> None:
        self._diagnostics.forget()
        if self._binding_waits is not None:
            self._binding_waits.forget()
        if self._clearing is not None:
            self._clearing.forget()
        if self._node_steering is not None:
            self._node_steering.forget()
        if self._leftover_rules is not None:
            self._leftover_rules.forget()
        self._pending_clock = metrics.PendingClock()
        metrics.POOL.update(None)

    def tick(self) -> None:
        leader = self._is_leader()
        metrics.LEADER.set(1 if leader else 0)
        if not leader:
            if self._was_leader:
                self._demote()
            self._was_leader = False
            return
        self._was_leader = True
        if not self._state.synced():
            return
        snapshot = self._state.snapshot()
        wall = datetime.now(UTC)
        result = self._diagnostics.run_pass(snapshot, wall)
        binding = None
        if self._binding_waits is not None:
            binding = self._binding_waits.run_pass(snapshot, wall).by_condition
        metrics.POOL.update(
            metrics.pool_figures(snapshot, wall, result.unsatisfiable, binding_pending=binding)
        )
        self._pending_clock.update(snapshot, wall)
        if self._state.synced(("policies",)) and self._is_leader():
            patches = policy_status.desired_patches(snapshot.policies, snapshot.nodes, wall)
            if patches:
                policy_status.apply_patches(self._api, patches)
        if self._leftover_rules is not None and self._is_leader():
            self._leftover_rules.run_pass()
        if self._clearing is not None and self._is_leader():
            steered: set[str] = set()
            if self._node_steering is not None:
                steered = set(self._node_steering.active)
            self._clearing.run_pass(snapshot, wall, steered)
        if self._node_steering is not None and self._is_leader():
            # After clearing: a node where a GPU is being cleared is not steered.
            gpus: set[str] = set()
            if self._clearing is not None:
                gpus = {s.gpu for s in self._clearing.active.values()}
            cleared = {gpu.partition("/")[0] for gpu in gpus}
            self._node_steering.run_pass(snapshot, wall, cleared, gpus)
        self.passes += 1
