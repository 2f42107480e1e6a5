"""Applies the GpuNodePolicy that selects this node, GPU by GPU, without draining the node.

A GPU whose mode or MIG layout must change is first tainted (NoSchedule) in the published
slices so nothing new lands on it; while prepared claims still use it the change waits
(status Pending, with the claims named); once idle its MIG instances are changed through the
backend, the slices republished and the taint lifted. Other GPUs keep serving throughout.
A layout that does not fit a GPU is refused in the policy's status and the GPU left as it is.
With no matching policy the plugin's command-line modes apply; with a tie nothing changes.

The agent reads GpuNodePolicies and this Node from watched local copies, so re-evaluating
(after every unprepare, on any change of a policy or of the node's labels, and once a minute
to catch hardware drift) costs no API request; only a changed policy status is written.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from flexgpu.driver.backend_errors import GpuBackendError
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.loop import Loop
from flexgpu.driver.mig_layout import LayoutError, MigPlacementPlan, layout_of, validate_layout
from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.node_policy import (
    APPLIED_CONDITION,
    PLURAL,
    VERSION,
    ConditionStatus,
    ExistingMigDevices,
    GpuMode,
    GpuModeSpec,
    GpuNodePolicy,
    GpuStatus,
    NodePolicyError,
    NodeStatus,
    PolicyReason,
    gpu_modes,
    gpu_status,
    node_condition,
    node_status_patch,
    parse_node_policy,
    select_policy,
    set_condition,
)
from flexgpu.kubelet_plugin.agents.mig_ownership import MigOwnership
from flexgpu.kubelet_plugin.api.kube_api import MERGE_PATCH, KubeApi, path_of
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects
from flexgpu.kubelet_plugin.claims.prepare_lock import LockTimeout, PrepareLock, gpu_key
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

log = logging.getLogger(__name__)

# Nothing is read from the API on this beat: it re-applies the cached inputs, so a GPU whose
# state changed underneath (a failed change, a reset) is put right without any event.
RESYNC_S = 60.0
# After a failed pass (a status write refused, a GPU change that failed).
RETRY_S = 5.0


@dataclass(frozen=True)
class Want:
    mode: GpuMode
    layout: Mapping[str, int] | None = None
    spec: GpuModeSpec | None = None


class PolicyAgent:
    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        *,
        devices: NodeDevices,
        preparer: ClaimPreparerImpl,
        lock: PrepareLock,
        republish: Callable[[], None],
        interval_s: float = RESYNC_S,
        ignore_xids: Callable[[frozenset[int]], None] | None = None,
        ownership: MigOwnership | None = None,
    ) -> None:
        self._api = api
        # MIG devices flexgpu made for a layout; None: every instance counts as flexgpu's.
        self._ownership = ownership
        # Told the node's policy's spec.health.ignoredXids (health_monitor.py).
        self._ignore_xids = ignore_xids
        self.node_name = node_name
        self.policies = WatchedObjects(
            api,
            path_of("apis", CRD_GROUP, VERSION, PLURAL),
            on_change=self.poke,
            name="gpunodepolicies",
        )
        self.node = WatchedObjects(
            api,
            path_of("api", "v1", "nodes"),
            query={"fieldSelector": f"metadata.name={node_name}"},
            on_change=self._node_changed,
            name="node",
        )
        self._node_labels: dict[str, str] | None = None
        # Parsed policies by (name, resourceVersion): parsing is done once per change.
        self._parsed: dict[tuple[str, str], GpuNodePolicy | None] = {}
        # Status we wrote per policy, with the resourceVersion it was written over: until
        # the watch brings our own write back, the copy is older than what we wrote.
        self._written: dict[str, tuple[str | None, NodeStatus]] = {}
        self._devices = devices
        self._preparer = preparer
        self._lock = lock
        self._republish = republish
        # What the plugin's flags say, for GPUs no policy covers.
        self._defaults: dict[int, GpuMode] = {
            g.index: devices.mode(g.index) for g in devices.gpus()
        }
        # Nothing is read from the API on its beat (see RESYNC_S); a failed pass is retried
        # after a jittered delay of at most RETRY_S.
        self._loop = Loop("node-policy", self._step, interval_s, backoff=Backoff(1.0, RETRY_S))
        self._announced = False
        # Whether a GPU waits for its claims to go (or a pass failed, or none has run yet):
        # only then can an unprepare let a change proceed, so only then does it poke.
        self._waiting = True
        self.passes = 0  # evaluations finished, for tests

    def start(self) -> None:
        self.policies.start()
        self.node.start()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        self.policies.stop()
        self.node.stop()

    @property
    def last_error(self) -> str | None:
        """Why the last pass failed; None once one succeeds."""
        return self._loop.last_error

    def _node_changed(self) -> None:
        # The kubelet updates its Node's status all the time; only labels select policies.
        node = self.node.get(self.node_name)
        labels = dict(((node or {}).get("metadata") or {}).get("labels") or {})
        if node is None or labels != self._node_labels:
            self._node_labels = labels
            self.poke()

    def poke(self) -> None:
        """Re-evaluate soon."""
        self._loop.poke()

    def claim_unprepared(self) -> None:
        """A claim was unprepared: a change waiting for its GPU may proceed now. Without one
        waiting, a pass would find nothing to do (and cost CPU on every unprepare)."""
        if self._waiting:
            self.poke()

    def _step(self) -> None:
        # Until both copies are filled, "no policy" would only mean "not read yet": acting on
        # it could undo a layout a policy asks for. Their first fill pokes the loop.
        if not (self.policies.synced and self.node.synced):
            return
        if not self._announced:
            self._announced = True
            log.info(
                "node policy agent: watching %d GpuNodePolicies and node %s",
                len(self.policies.items()),
                self.node_name,
            )
        self.reconcile_once()
        self.passes += 1

    # -- one pass ------------------------------------------------------------------------
    def reconcile_once(self) -> None:
        # Until this pass has finished, an unprepare may be what a change waits for.
        self._waiting = True
        policies = self._policies()
        node = self.node.get(self.node_name)
        if node is None:
            raise RuntimeError(f"node {self.node_name} not found; no policy applied")
        labels = (node.get("metadata") or {}).get("labels") or {}
        choice = select_policy(policies, dict(labels))
        gpus = self._devices.gpus()
        if choice.is_conflict:
            message = choice.conflict_message(self.node_name)
            for policy in choice.conflict:
                self._write_status(policy, {}, message)
            log.warning("%s", message)
            self._waiting = False  # only a policy change (a watch event) can end a conflict
            return
        if self._ignore_xids is not None:
            health = choice.policy.spec.health if choice.policy is not None else None
            self._ignore_xids(frozenset(health.ignoredXids or ()) if health else frozenset())
        wants = self._wants(choice.policy, gpus)
        busy = self._busy_gpus()
        modes: dict[int, GpuMode] = {g.index: self._devices.mode(g.index) for g in gpus}
        statuses: dict[str, GpuStatus] = {}
        taints: dict[int, str] = {}
        for gpu in sorted(gpus, key=lambda g: g.index):
            want = wants[gpu.index]
            reason, message = self._reconcile_gpu(gpu, want, busy, modes, taints)
            if want.spec is not None:
                current = self._current_layout(gpu)
                statuses[str(gpu.index)] = gpu_status(want.spec, gpu, reason, message, current)
        self._devices.set_taints(taints)
        self._devices.set_modes(modes)
        self._republish()
        if choice.policy is not None:
            self._write_status(choice.policy, statuses, "")
        # A taint marks every GPU whose change is pending (busy or failed).
        self._waiting = bool(taints)

    def _reconcile_gpu(
        self,
        gpu: GpuInfo,
        want: Want,
        busy: Mapping[int, list[str]],
        modes: dict[int, GpuMode],
        taints: dict[int, str],
    ) -> tuple[PolicyReason, str]:
        plan: list[MigPlacementPlan] = []
        if want.mode == GpuMode.MIG:
            try:
                profiles = self._devices.mig_profiles(gpu.index) if gpu.mig_capable else []
                plan = validate_layout(want.layout or {}, gpu, profiles)
            except (LayoutError, GpuBackendError) as err:
                reason = getattr(err, "reason", PolicyReason.UNSUPPORTED)
                text = getattr(err, "message", str(err))
                return PolicyReason(str(reason)), text
        current_mode = modes.get(gpu.index, GpuMode.WHOLE)
        current_layout = self._current_layout(gpu)
        same_layout = current_layout == dict(want.layout or {})
        if current_mode == want.mode and (want.mode != GpuMode.MIG or same_layout):
            return PolicyReason.APPLIED, ""
        mig_on = gpu.mig_mode is not None and gpu.mig_mode.current
        if want.mode == GpuMode.MIG and current_mode == GpuMode.WHOLE and mig_on and same_layout:
            # Laid out beforehand exactly as asked (adopted): serve it, change nothing.
            modes[gpu.index] = GpuMode.MIG
            log.info("GPU %d: its MIG devices already match the policy's layout", gpu.index)
            return PolicyReason.APPLIED, ""
        foreign = self._foreign_mig_devices(gpu, current_mode)
        if foreign and (want.spec is None or want.spec.existing_mig != ExistingMigDevices.REPLACE):
            # Nothing new is kept off the GPU: it serves what it has until the admin decides.
            where = f"spec.gpus[{want.spec.entry}]" if want.spec is not None else "a GpuNodePolicy"
            return PolicyReason.PENDING, (
                f"not changed to {_describe(want)}: GPU {gpu.index} holds MIG devices flexgpu "
                f"did not create ({', '.join(foreign)}); set {where}.existingMigDevices: "
                "Replace to let flexgpu destroy them"
            )
        users = busy.get(gpu.index, [])
        if not users:
            try:
                # The GPU's resource lock, as prepare holds it: a prepare that took it first
                # has recorded its claim by the time we get it, so it is seen as a user.
                with self._lock.resources({gpu_key(gpu.index)}):
                    users = self._busy_gpus().get(gpu.index, [])
                    if not users:
                        self._change(gpu, current_mode, want, plan)
            except (GpuBackendError, LockTimeout) as err:
                taints[gpu.index] = "reconfiguring"
                return PolicyReason.PENDING, f"changing to {_describe(want)} failed: {err}"
        if users:
            taints[gpu.index] = "reconfiguring"
            return PolicyReason.PENDING, (
                f"waiting to change to {_describe(want)}: in use by claim(s) "
                f"{', '.join(sorted(users))}; new claims are kept off it meanwhile"
            )
        modes[gpu.index] = want.mode
        log.info("GPU %d is now %s", gpu.index, _describe(want))
        return PolicyReason.APPLIED, ""

    def _foreign_mig_devices(self, gpu: GpuInfo, current: GpuMode) -> list[str]:
        """MIG devices on the GPU that flexgpu did not create, as ``profile@start``. On a
        dynamic-MIG GPU every instance is a claim's (start-up reconcile removes others)."""
        if self._ownership is None or current == GpuMode.DYNAMIC_MIG or not gpu.mig_capable:
            return []
        if gpu.mig_mode is None or not gpu.mig_mode.current:
            return []
        owned = self._ownership.owned()
        return [
            f"{d.profile_name}@{d.placement.start}"
            for d in self._devices.backend.list_mig_devices(gpu.index)
            if d.uuid is None or d.uuid not in owned
        ]

    def _change(
        self, gpu: GpuInfo, current: GpuMode, want: Want, plan: list[MigPlacementPlan]
    ) -> None:
        backend = self._devices.backend
        mig_on = gpu.mig_mode is not None and gpu.mig_mode.current
        if mig_on:
            # Idle GPU: any instance left is the old layout's, a dynamic leftover, or (with
            # existingMigDevices: Replace) another tool's.
            for instance in backend.list_mig_devices(gpu.index):
                backend.destroy_mig_device(gpu.index, instance.gpu_instance_id)
                if self._ownership is not None and instance.uuid is not None:
                    self._ownership.update(removed=[instance.uuid])
        if want.mode in (GpuMode.MIG, GpuMode.DYNAMIC_MIG) and not mig_on:
            mode = backend.set_mig_mode(gpu.index, True)
            if not mode.current:
                raise GpuBackendError("enabling MIG mode needs a GPU reset")
        if want.mode in (GpuMode.WHOLE, GpuMode.SHARED) and mig_on:
            backend.set_mig_mode(gpu.index, False)
        for step in plan:
            made = backend.create_mig_device(gpu.index, step.profile_id, step.placement)
            if self._ownership is not None and made.uuid is not None:
                self._ownership.update(added=[made.uuid])
        self._devices.refresh()

    # -- inputs ----------------------------------------------------------------------------
    def _policies(self) -> list[GpuNodePolicy]:
        parsed: dict[tuple[str, str], GpuNodePolicy | None] = {}
        for item in self.policies.items():
            meta = item.get("metadata") or {}
            key = (str(meta.get("name", "")), str(meta.get("resourceVersion", "")))
            if key in self._parsed:
                parsed[key] = self._parsed[key]
                continue
            try:
                parsed[key] = parse_node_policy(item)
            except NodePolicyError as err:  # admission rejects these; never crash on one
                log.warning("ignoring invalid GpuNodePolicy %s: %s", key[0], err)
                parsed[key] = None
        self._parsed = parsed
        return [p for p in parsed.values() if p is not None]

    def _wants(self, policy: GpuNodePolicy | None, gpus: list[GpuInfo]) -> dict[int, Want]:
        wants = {g.index: Want(self._defaults.get(g.index, GpuMode.WHOLE)) for g in gpus}
        if policy is not None:
            for index, spec in gpu_modes(policy, gpus).items():
                wants[index] = Want(spec.mode, spec.mig_layout, spec)
        return wants

    def _busy_gpus(self) -> dict[int, list[str]]:
        users: dict[int, list[str]] = {}
        for record in self._preparer.load_checkpoint().claims.values():
            for device in record.devices:
                gpu = self._devices.gpu(device.device_name)
                if gpu is not None:
                    users.setdefault(gpu.index, []).append(f"{record.namespace}/{record.name}")
        return users

    def _current_layout(self, gpu: GpuInfo) -> dict[str, int] | None:
        if not gpu.mig_capable:
            return None
        return layout_of(self._devices.backend.list_mig_devices(gpu.index))

    # -- status ----------------------------------------------------------------------------
    def _write_status(
        self, policy: GpuNodePolicy, gpus: dict[str, GpuStatus], conflict: str
    ) -> None:
        old = policy.status.nodes.get(self.node_name) if policy.status else None
        status, reason, message = node_condition(gpus, conflict)
        now = datetime.datetime.now(datetime.UTC)
        generation = policy.metadata.generation
        conditions = set_condition(
            old.conditions if old else [],
            APPLIED_CONDITION,
            status=status,
            reason=reason.value,
            message=message,
            now=now,
            observed_generation=generation,
        )
        new = NodeStatus(observedGeneration=generation, gpus=gpus, conditions=conditions)
        if old is not None and old == new:
            return
        version = policy.metadata.resourceVersion
        if self._written.get(policy.name) == (version, new):
            return  # written already; the watch has not brought it back yet
        self._api.request(
            "PATCH",
            path_of("apis", CRD_GROUP, VERSION, PLURAL, policy.name, "status"),
            body=node_status_patch(self.node_name, new, old),
            content_type=MERGE_PATCH,
        )
        self._written[policy.name] = (version, new)
        if status is not ConditionStatus.TRUE:
            log.info("policy %s on %s: %s: %s", policy.name, self.node_name, reason, message)


def _describe(want: Want) -> str:
    if want.mode == GpuMode.MIG:
        layout = ", ".join(f"{n}x{c}" for n, c in sorted((want.layout or {}).items()))
        return f"MIG {layout}"
    return want.mode
