"""Leader election on a ``coordination.k8s.io/v1`` Lease, so two replicas can run and only one
does the active work.

The rules are client-go's: a candidate takes the lease when the record it last saw has not
changed for a whole ``leaseDurationSeconds`` (measured on the candidate's own monotonic clock,
so clock skew between machines does not matter); every write carries the resourceVersion that
was read, so two candidates racing for an expired lease cannot both win (the loser gets 409).
The holder renews every ``retry_s``; if it cannot renew for ``renew_deadline_s`` it considers
itself demoted before anyone else may take over (deadline < duration), so two replicas never
both believe they lead. A clean shutdown releases the lease for an immediate takeover.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from kubernetes import client

from flexgpu.driver.loop import Loop

log = logging.getLogger(__name__)

LEASE_DURATION_S: Final = 15
RENEW_DEADLINE_S: Final = 10.0
RETRY_S: Final = 5.0
# A follower looks more often than the holder renews, to notice expiry within ~2 s of it.
FOLLOWER_RETRY_S: Final = 2.0
HTTP_NOT_FOUND: Final = 404
HTTP_CONFLICT: Final = 409


def micro_time(moment: datetime) -> str:
    """metav1.MicroTime text."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    duration_s: int
    renew_time: str
    acquire_time: str
    transitions: int


def _record(spec: dict[str, Any]) -> LeaseRecord:
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_s=int(spec.get("leaseDurationSeconds") or LEASE_DURATION_S),
        renew_time=str(spec.get("renewTime") or ""),
        acquire_time=str(spec.get("acquireTime") or ""),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


class LeaseElector:
    def __init__(
        self,
        api: client.ApiClient,
        *,
        name: str,
        namespace: str,
        identity: str,
        duration_s: int = LEASE_DURATION_S,
        renew_deadline_s: float = RENEW_DEADLINE_S,
        retry_s: float = RETRY_S,
        follower_retry_s: float = FOLLOWER_RETRY_S,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        owner: Mapping[str, Any] | None = None,
    ) -> None:
        if renew_deadline_s >= duration_s:
            raise ValueError("the renew deadline must be shorter than the lease duration")
        self._api = client.CoordinationV1Api(api)
        self.name, self.namespace, self.identity = name, namespace, identity
        self.duration_s = duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_s = retry_s
        self.follower_retry_s = follower_retry_s
        self._on_change = on_change
        self._clock = clock
        # An ownerReference (the controller's Deployment): the Lease goes with its owner.
        self._owners = [dict(owner)] if owner is not None else []
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None  # last successful write as holder
        self._leading = False
        # Written on the Lease with each renewal (the claim labeller's mark); dropped when
        # this replica takes the lease over, so a mark always speaks of the current term.
        self.annotations: dict[str, str] = {}
        self._loop = Loop("leader-election", self._round, self.retry_s)

    # -- state -------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while this replica holds a lease it renewed within the renew deadline."""
        renewed = self._renewed_at
        return renewed is not None and self._clock() - renewed < self.renew_deadline_s

    @property
    def holder(self) -> str:
        return self._observed.holder if self._observed else ""

    def _set_leading(self, leading: bool) -> None:
        if leading != self._leading:
            self._leading = leading
            log.info(
                "%s %s lease %s/%s",
                self.identity,
                "acquired" if leading else "lost",
                self.namespace,
                self.name,
            )
            if self._on_change is not None:
                self._on_change(leading)

    # -- one round -----------------------------------------------------------------------
    def _observe(self, record: LeaseRecord) -> None:
        if record != self._observed:
            self._observed = record
            self._observed_at = self._clock()

    def _spec(self, acquire: bool, previous: LeaseRecord | None) -> dict[str, Any]:
        now = micro_time(datetime.now(UTC))
        transitions = previous.transitions if previous else 0
        if acquire and previous is not None and previous.holder != self.identity:
            transitions += 1
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration_s,
            "acquireTime": now if acquire or previous is None else previous.acquire_time,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the lease afterwards."""
        try:
            lease: Any = self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=5
            )
        except client.ApiException as err:
            if err.status != HTTP_NOT_FOUND:
                raise
            spec = self._spec(True, None)
            self.annotations.clear()
            body: Any = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.name,
                    "namespace": self.namespace,
                    **({"ownerReferences": self._owners} if self._owners else {}),
                },
                "spec": spec,
            }
            try:
                self._api.create_namespaced_lease(self.namespace, body, _request_timeout=5)
            except client.ApiException as create_err:
                if create_err.status == HTTP_CONFLICT:
                    return False  # another candidate created it first
                raise
            self._observe(_record(spec))
            return True
        raw = client.ApiClient().sanitize_for_serialization(lease.spec) or {}
        record = _record(raw)
        self._observe(record)
        mine = record.holder == self.identity
        expired = self._clock() - self._observed_at >= record.duration_s
        if not mine and record.holder and not expired:
            return False
        spec = self._spec(not mine, record)
        if not mine:
            self.annotations.clear()
        annotations = dict(self.annotations)
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": lease.metadata.resource_version,
                **({"ownerReferences": self._owners} if self._owners else {}),
                **({"annotations": annotations} if annotations else {}),
            },
            "spec": spec,
        }
        try:
            self._api.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=5)
        except client.ApiException as err:
            if err.status == HTTP_CONFLICT:
                return False  # changed since we read it: someone else renewed or took it
            raise
        self._observe(_record(spec))
        return True

    def step(self) -> bool:
        """One round with bookkeeping: updates ``is_leader`` and calls ``on_change``."""
        try:
            if self.try_acquire_or_renew():
                self._renewed_at = self._clock()
        except Exception as err:  # the API may be briefly unreachable; the deadline decides
            log.warning("lease %s/%s: %s", self.namespace, self.name, err)
        if not self.is_leader:
            self._renewed_at = None
        self._set_leading(self.is_leader)
        return self._leading

    def release(self) -> None:
        """Gives the lease up (clean shutdown) so a follower takes over at its next look."""
        if not self._leading:
            return
        self._renewed_at = None
        self._set_leading(False)
        try:
            lease: Any = self._api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=5
            )
            if lease.spec.holder_identity != self.identity:
                return
            self._api.patch_namespaced_lease(
                self.name,
                self.namespace,
                {
                    "metadata": {"resourceVersion": lease.metadata.resource_version},
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1},
                },
                _request_timeout=5,
            )
        except client.ApiException as err:
            log.warning("could not release lease %s/%s: %s", self.namespace, self.name, err)

    # -- background loop -------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start()

    def _round(self) -> float:
        """One round; the seconds until the next (a leader renews sooner than a follower
        looks)."""
        return self.retry_s if self.step() else self.follower_retry_s

    def stop(self, release: bool = True) -> None:
        self._loop.stop()
        if release:
            self.release()
