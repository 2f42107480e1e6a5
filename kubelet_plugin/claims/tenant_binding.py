"""Which namespace a free shared GPU goes to, decided before any pod is bound (binding
conditions, Kubernetes 1.36+).

Admission's selector keeps a claim off a shared GPU whose published ``tenant`` is another
namespace, but claims created in the same instant are all allocated before any tenant is
published. So a free shared GPU carries the binding conditions ``TenantReady`` /
``TenantTaken`` (resource_slice.with_tenant) and the scheduler holds each pod allocated there
until the plugin has decided. Claims are decided one at a time, on one thread, oldest
allocation first: the first namespace to reach a free GPU gets it (``TenantReady``; its
tenant is then published, which drops the conditions for that namespace's next claims), and a
claim of another namespace allocated there in the same instant is sent back to be scheduled
(``TenantTaken``), by which time the published tenant keeps it off that GPU. No pod of a mix
is ever bound, so none waits in ContainerCreating for prepare's guard (tenancy.py), which
stays as the last check.

Who holds a GPU: the namespaces of the node's claim records (prepared, or being prepared), of
claims allocated there without the conditions (allocated while its tenant was published) and
of claims given ``TenantReady``. A claim still waiting holds nothing, so two waiting claims
never block each other. Pure: no I/O; binding_watch.py reads the claims and writes status.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.names import DRIVER_NAME, TENANT_READY_CONDITION, TENANT_TAKEN_CONDITION
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.claim_status import Condition, DeviceStatus
from flexgpu.kubelet_plugin.claims.tenancy import gpus_shared_by

__all__ = ["TenantBinding", "TenantDecision", "tenant_ready"]


def tenant_ready(gpu_index: int, namespace: str) -> Condition:
    """The binding condition of a claim whose namespace the shared GPU serves; prepare keeps
    it true, since the scheduler checks it for every pod that uses the claim."""
    return Condition(
        TENANT_READY_CONDITION,
        "True",
        "TenantServed",
        f"gpu-{gpu_index} serves namespace {namespace}",
    )


def _tenant_taken(gpu_index: int, node_name: str) -> Condition:
    # Another tenant's namespace is not named: the claim's owner learns only that it is
    # another namespace.
    return Condition(
        TENANT_TAKEN_CONDITION,
        "True",
        "TenantTaken",
        f"gpu-{gpu_index} of node {node_name} already serves another namespace (a shared GPU "
        "serves one namespace at a time); the pod is scheduled again",
    )


@dataclass(frozen=True)
class TenantDecision:
    """A claim decided: the status entries to write, and whether it was sent back."""

    claim: ClaimView
    statuses: tuple[DeviceStatus, ...]
    taken: bool


class TenantBinding:
    def __init__(self, node_name: str, shared_gpu_index: Callable[[str], int | None]) -> None:
        self._node = node_name
        self._gpu_of = shared_gpu_index
        # Claim UID -> (namespace, GPU indices) of claims given TenantReady, until the claim
        # is deallocated: our status write may not have come back on the watch yet.
        self._ready: dict[str, tuple[str, frozenset[int]]] = {}
        # Claim UID -> the devices it was sent back from, while it keeps that allocation.
        self._taken: dict[str, tuple[str, ...]] = {}
        # GPU index -> namespaces that hold it through allocated claims (not records).
        self._holders: dict[int, set[str]] = {}

    def shared_devices(self, claim: ClaimView) -> dict[int, list[AllocatedDevice]]:
        """GPU index -> the claim's devices of this node on that shared GPU."""
        out: dict[int, list[AllocatedDevice]] = {}
        for device in claim.devices:
            if device.driver != DRIVER_NAME or device.pool != self._node:
                continue
            index = self._gpu_of(device.device)
            if index is not None:
                out.setdefault(index, []).append(device)
        return out

    def waiting(self, claim: ClaimView) -> dict[int, list[AllocatedDevice]]:
        """The claim's shared devices allocated with the tenant binding condition."""
        return {
            index: found
            for index, devices in self.shared_devices(claim).items()
            if (found := [d for d in devices if TENANT_READY_CONDITION in d.binding_conditions])
        }

    def sent_back(self, uid: str) -> bool:
        """Whether the claim was sent back (TenantTaken) and keeps that allocation."""
        return uid in self._taken

    def holders(self) -> dict[int, str]:
        """GPU index -> the namespace its allocated claims hold it for (the first by name if
        several do), for the published tenant; records are added by the caller."""
        return {index: min(names) for index, names in self._holders.items() if names}

    def decide(
        self,
        claims: Sequence[ClaimView],
        told: Mapping[str, Set[str]],
        records: Callable[[], Iterable[ClaimRecord]],
    ) -> list[TenantDecision]:
        """Decides every claim that waits for a tenant, in the order given (oldest allocation
        first). ``claims``: this node's allocated claims with a shared device; ``told``: the
        condition types already true on each claim's entries of this node; ``records``: reads
        the node's claim records, only when a claim is left to decide (the watch runs this
        on every change of a kept claim)."""
        by_uid = {c.uid: c for c in claims}
        self._forget(by_uid)
        # Built aside and swapped in at the end: holders() is read from other threads.
        holders: dict[int, set[str]] = {}
        for claim in claims:
            pending = self.waiting(claim)
            if TENANT_READY_CONDITION in told.get(claim.uid, set()) and pending:
                self._ready.setdefault(claim.uid, (claim.namespace, frozenset(pending)))
            for index in self.shared_devices(claim):
                if index not in pending or claim.uid in self._ready:
                    holders.setdefault(index, set()).add(claim.namespace)
        undecided = []
        for claim in claims:
            if not self.waiting(claim) or claim.uid in self._ready or claim.uid in self._taken:
                continue
            if TENANT_TAKEN_CONDITION in told.get(claim.uid, set()):
                self._taken[claim.uid] = _devices(claim)
                continue
            undecided.append(claim)
        held = self._held_by_records(records()) if undecided else {}
        for index, names in holders.items():
            held.setdefault(index, set()).update(names)

        decisions = []
        for claim in undecided:
            pending = self.waiting(claim)
            others = sorted(
                index
                for index in pending
                if any(name != claim.namespace for name in held.get(index, set()))
            )
            if others:
                self._taken[claim.uid] = _devices(claim)
                taken = _tenant_taken(others[0], self._node)
                statuses = _statuses(pending, dict.fromkeys(pending, taken))
                decisions.append(TenantDecision(claim, statuses, taken=True))
                continue
            self._ready[claim.uid] = (claim.namespace, frozenset(pending))
            for index in pending:
                held.setdefault(index, set()).add(claim.namespace)
                holders.setdefault(index, set()).add(claim.namespace)
            ready = {index: tenant_ready(index, claim.namespace) for index in pending}
            statuses = _statuses(pending, ready)
            decisions.append(TenantDecision(claim, statuses, taken=False))
        self._holders = holders
        return decisions

    def _forget(self, claims: Mapping[str, ClaimView]) -> None:
        """Drops what was decided for claims that left (deallocated, deleted) or changed."""
        self._ready = {
            uid: ready
            for uid, ready in self._ready.items()
            if uid in claims and set(self.waiting(claims[uid])) == set(ready[1])
        }
        self._taken = {
            uid: devices
            for uid, devices in self._taken.items()
            if uid in claims and devices == _devices(claims[uid])
        }

    def _held_by_records(self, records: Iterable[ClaimRecord]) -> dict[int, set[str]]:
        held: dict[int, set[str]] = {}
        for record in records:
            for index in gpus_shared_by(record, self._gpu_of):
                held.setdefault(index, set()).add(record.namespace)
        return held


def _statuses(
    pending: Mapping[int, list[AllocatedDevice]], conditions: Mapping[int, Condition]
) -> tuple[DeviceStatus, ...]:
    return tuple(
        DeviceStatus(d.pool, d.device, d.share_id, {}, (conditions[index],))
        for index, devices in sorted(pending.items())
        for d in devices
    )


def _devices(claim: ClaimView) -> tuple[str, ...]:
    return tuple(sorted(f"{d.pool}/{d.device}/{d.share_id or ''}" for d in claim.devices))
