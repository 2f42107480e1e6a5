"""Reading and evicting the pods that hold a place being emptied (``controller.place_eviction``):
what the leader asks of the API server, behind small interfaces the tests stand in for.

Pods are evicted through the Eviction API (policy/v1, the pods/eviction subresource), so
PodDisruptionBudgets are honoured: a 429 means a budget allows no disruption now. Any other
error status is that pod's answer (``refused``), never the pass's: raising would end every
pass while the pod exists.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Protocol

from kubernetes import client

from flexgpu.controller.events import EventTarget
from flexgpu.controller.records import CachedClaim, PodRecord, pod_record
from flexgpu.driver.allocation.consolidation import Holder, HolderPod

HTTP_NOT_FOUND: Final = 404
HTTP_CONFLICT: Final = 409  # the uid precondition failed: the pod of that name is a new one
HTTP_TOO_MANY: Final = 429  # a PodDisruptionBudget allows no disruption now


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
            # answer, not the pass's.
            return "refused", f"HTTP {err.status}: {_reason(err)}"
        return "evicted", ""


def _reason(err: client.ApiException) -> str:
    try:
        return str(json.loads(err.body or "{}").get("message") or err.reason)
    except ValueError:
        return str(err.reason)


def read_holder(
    claim: CachedClaim, pods: PodReader, budgets: BudgetReader
) -> tuple[Holder, PodRecord | None]:
    """The holding claim with its pod as the server has it now, as far as moving it is
    concerned (``driver.allocation.consolidation``)."""
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
