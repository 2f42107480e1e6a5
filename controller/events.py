"""Warning Events on pods and claims (core/v1, which ``kubectl describe`` shows for both).

An Event's name is derived from the object's uid and the text, so the same diagnosis written
twice, by this replica after a restart or by a new leader right after a failover, lands on the
same Event instead of a duplicate; a deliberate repeat bumps its count, as the kubelet's
recorder does.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from kubernetes import client

log = logging.getLogger(__name__)

COMPONENT: Final = "flexgpu-controller"
HTTP_CONFLICT: Final = 409
HTTP_NOT_FOUND: Final = 404


@dataclass(frozen=True)
class EventTarget:
    kind: str  # Pod, ResourceClaim or PodGroup
    api_version: str  # v1, resource.k8s.io/v1 or scheduling.k8s.io/v1beta1
    namespace: str
    name: str
    uid: str


class EventSink(Protocol):
    def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
        """Records a Warning; ``repeat`` bumps the count of an identical earlier one."""


def event_name(target: EventTarget, reason: str, message: str) -> str:
    digest = hashlib.sha256(f"{target.uid}\0{reason}\0{message}".encode()).hexdigest()[:16]
    # Object names are DNS subdomains of at most 253 characters.
    return f"{target.name[:200]}.{digest}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    def __init__(self, api: client.ApiClient, instance: str) -> None:
        self._core = client.CoreV1Api(api)
        self._instance = instance

    def emit(
        self,
        target: EventTarget,
        reason: str,
        message: str,
        *,
        repeat: bool,
        event_type: str = "Warning",
    ) -> None:
        name = event_name(target, reason, message)
        now = _now()
        # Events about cluster-scoped objects (Nodes) live in "default", as kubectl looks.
        namespace = target.namespace or "default"
        body: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {
                "apiVersion": target.api_version,
                "kind": target.kind,
                "namespace": target.namespace,
                "name": target.name,
                "uid": target.uid,
            },
            "reason": reason,
            "message": message,
            "type": event_type,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._core.create_namespaced_event(namespace, body)
            return
        except client.ApiException as err:
            if err.status != HTTP_CONFLICT:
                raise
        if not repeat:
            return  # already said, by us before a restart or by the previous leader
        try:
            current: Any = self._core.read_namespaced_event(name, namespace)
            self._core.patch_namespaced_event(
                name,
                namespace,
                {"count": (current.count or 1) + 1, "lastTimestamp": now},
            )
        except client.ApiException as err:
            if err.status != HTTP_NOT_FOUND:  # expired between the two calls: nothing to bump
                raise
