"""The controller's parts wired together: cache and watches (every replica), lease elector,
the leader's work, the metrics endpoint. ``controller.main`` runs this inside kopf."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from flexgpu.controller import kube, metrics
from flexgpu.controller.active import ActiveWork
from flexgpu.controller.binding_waits import DEFAULT_GRACE_S, BindingWaits
from flexgpu.controller.claim_labels import ClaimLabeller
from flexgpu.controller.clearing import DEFAULT_MAX_S, Clearing
from flexgpu.controller.clearing_eviction import Evictions
from flexgpu.controller.cluster_state import ClusterState, Kind
from flexgpu.controller.diagnostics import Diagnostics
from flexgpu.controller.disruption_budgets import Budgets
from flexgpu.controller.events import EventRecorder
from flexgpu.controller.idle_events import IdleClaimNotifier, claim_reader
from flexgpu.controller.leader import LeaseElector
from flexgpu.controller.node_eviction import NodeEvictions
from flexgpu.controller.node_steering import NodeSteering
from flexgpu.controller.place_eviction import DEFAULT_MAX_IN_FLIGHT
from flexgpu.controller.pod_eviction import ApiPods
from flexgpu.controller.reflector import Reflector, Store, start_reflectors
from flexgpu.controller.taint_rule_sweep import LeftoverRules
from flexgpu.controller.taint_rules import TaintRules
from flexgpu.driver.allocation.node_clearing import DEFAULT_MAX_HELD_SHARE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    identity: str
    lease_name: str
    lease_namespace: str
    pending_delay_s: float
    recheck_s: float
    reemit_s: float
    metrics_port: int | None
    metrics_address: str = "0.0.0.0"
    # Kubelet plugins' metrics endpoints (controller/plugin_endpoints.py) and the idle
    # window: with both, idle claims and their pods get an Event (controller/idle_events.py).
    plugin_metrics: tuple[str, ...] = ()
    idle_window_s: float | None = None
    idle_check_s: float = 60.0
    # ownerReference for the Lease (controller/owner.py): it goes with the Deployment.
    owner: dict[str, Any] | None = None
    # How long a pod may wait for flexgpu's binding conditions before it gets an Event.
    binding_grace_s: float = DEFAULT_GRACE_S
    # Share of the cluster's GPUs that may be kept clear for waiting claims at once (0: off;
    # controller/clearing.py), and how long one GPU is kept clear at most.
    clearing_share: float = 0.0
    clearing_max_s: float = DEFAULT_MAX_S
    # Evict the pods that opted in from a GPU steered this long (None: never evict;
    # controller/clearing_eviction.py), at most this many in flight at once.
    clearing_evict_after_s: float | None = None
    clearing_evict_max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    # Node steering (controller/node_steering.py): at most this share of the cluster's GPUs
    # on nodes kept free of new claims (0: off), nodes holding at most max_held_share of
    # their GPUs, each at most max_s.
    node_steering_share: float = 0.0
    node_steering_max_held_share: float = DEFAULT_MAX_HELD_SHARE
    node_steering_max_s: float = DEFAULT_MAX_S
    # Only nodes carrying all these labels are steered and count as the group (empty: all).
    node_steering_nodes: Mapping[str, str] = field(default_factory=dict)
    # Evict the pods that opted in from a node steered this long (None: never evict;
    # controller/node_eviction.py), at most this many in flight at once (a bound of its own).
    node_steering_evict_after_s: float | None = None
    node_steering_evict_max_in_flight: int = DEFAULT_MAX_IN_FLIGHT


class Controller:
    def __init__(self, api: client.ApiClient, config: ControllerConfig) -> None:
        self.api = api
        self.config = config
        self.elector = LeaseElector(
            kube.clone(api),
            name=config.lease_name,
            namespace=config.lease_namespace,
            identity=config.identity,
            owner=config.owner,
        )
        self.labeller = ClaimLabeller(
            kube.clone(api), self.elector, synced=lambda: self.state.synced(("claims",))
        )
        self.state = ClusterState(listeners={"claims": self.labeller})
        work_api = kube.clone(api)
        self.diagnostics = Diagnostics(
            EventRecorder(work_api, config.identity),
            delay_s=config.pending_delay_s,
            recheck_s=config.recheck_s,
            reemit_s=config.reemit_s,
        )
        self.binding_waits = BindingWaits(
            EventRecorder(work_api, config.identity),
            grace_s=config.binding_grace_s,
            reemit_s=config.reemit_s,
        )
        self.clearing: Clearing | None = None
        # Watched only where clearing or node steering may evict: a budget is consent to it.
        self.budgets: Budgets | None = None
        pods = ApiPods(work_api)

        def evicting(budgets: Budgets) -> tuple[ApiPods, ApiPods, EventRecorder, Budgets]:
            """What either eviction reads, evicts and tells with (pods read and evicted
            through one client)."""
            return pods, pods, EventRecorder(work_api, config.identity), budgets

        clearing_evicts = config.clearing_share > 0 and config.clearing_evict_after_s is not None
        node_evicts = (
            config.node_steering_share > 0 and config.node_steering_evict_after_s is not None
        )
        if clearing_evicts or node_evicts:
            self.budgets = Budgets()
        if config.clearing_share > 0:
            evictions = None
            if config.clearing_evict_after_s is not None and self.budgets is not None:
                evictions = Evictions(
                    *evicting(self.budgets),
                    after_s=config.clearing_evict_after_s,
                    max_in_flight=config.clearing_evict_max_in_flight,
                )
            self.clearing = Clearing(
                TaintRules(work_api),
                EventRecorder(work_api, config.identity),
                delay_s=config.pending_delay_s,
                share=config.clearing_share,
                max_s=config.clearing_max_s,
                evictions=evictions,
            )
        self.node_steering: NodeSteering | None = None
        if config.node_steering_share > 0:
            node_evictions = None
            if config.node_steering_evict_after_s is not None and self.budgets is not None:
                node_evictions = NodeEvictions(
                    *evicting(self.budgets),
                    after_s=config.node_steering_evict_after_s,
                    max_in_flight=config.node_steering_evict_max_in_flight,
                )
            self.node_steering = NodeSteering(
                TaintRules(work_api),
                EventRecorder(work_api, config.identity),
                share=config.node_steering_share,
                max_held_share=config.node_steering_max_held_share,
                max_s=config.node_steering_max_s,
                node_labels=config.node_steering_nodes,
                evictions=node_evictions,
            )
        # Rules of a feature turned off would otherwise steer their devices for ever.
        self.leftover_rules = LeftoverRules(
            TaintRules(work_api),
            clearing_on=self.clearing is not None,
            steering_on=self.node_steering is not None,
        )
        self.work = ActiveWork(
            self.state,
            self.diagnostics,
            work_api,
            lambda: self.elector.is_leader,
            binding_waits=self.binding_waits,
            clearing=self.clearing,
            node_steering=self.node_steering,
            leftover_rules=self.leftover_rules,
        )
        self._reflectors: list[Reflector] = []
        self.idle: IdleClaimNotifier | None = None
        if config.plugin_metrics and config.idle_window_s is not None:
            self.idle = IdleClaimNotifier(
                config.plugin_metrics,
                EventRecorder(kube.clone(api), config.identity),
                read_claim=claim_reader(kube.clone(api)),
                is_leader=lambda: self.elector.is_leader,
                window_s=config.idle_window_s,
                interval_s=config.idle_check_s,
            )

    def start(self) -> None:
        if self.config.metrics_port is not None:
            metrics.serve(self.config.metrics_port, self.config.metrics_address)
        extra: dict[Kind, Store] = {}
        if self.budgets is not None:
            extra["budgets"] = self.budgets
        self._reflectors = start_reflectors(self.state, lambda: kube.clone(self.api), extra)
        self.elector.start()
        self.labeller.start()
        self.work.start()
        if self.idle is not None:
            self.idle.start()
        log.info(
            "flexgpu-controller %s started (lease %s/%s, pending delay %.0fs)",
            self.config.identity,
            self.config.lease_namespace,
            self.config.lease_name,
            self.config.pending_delay_s,
        )

    def stop(self) -> None:
        """Stops the active work first, then gives the lease up for a prompt takeover."""
        self.work.stop()
        self.labeller.stop()
        if self.idle is not None:
            self.idle.stop()
        self.elector.stop(release=True)
        for reflector in self._reflectors:
            reflector.stop()
        for reflector in self._reflectors:
            reflector.join(5)
