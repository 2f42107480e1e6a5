"""Reads ResourceClaims from the API server as plain data the preparer understands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flexgpu.driver.claim_results import AllocatedDevice, parse_allocated_device
from flexgpu.driver.device_metadata import POD_CLAIM_NAME_ANNOTATION
from flexgpu.kubelet_plugin.api.kube_api import ApiError, KubeApi, path_of
from flexgpu.kubelet_plugin.claims.claim_objects import ClaimObjects


@dataclass(frozen=True)
class ClaimView:
    uid: str
    namespace: str
    name: str
    allocated: bool
    devices: tuple[AllocatedDevice, ...] = ()
    # ``status.allocation.devices.config`` entries, class configs first as the API orders them.
    configs: tuple[Mapping[str, Any], ...] = ()
    # For a claim made from a ResourceClaimTemplate: its name in the pod's spec
    # (``pod.spec.resourceClaims[].name``), which names its device metadata folder.
    pod_claim_name: str | None = None


class ClaimSource(Protocol):
    def get(self, namespace: str, name: str) -> ClaimView | None:
        """The claim, or None when it does not exist."""


def parse_claim(obj: Mapping[str, Any]) -> ClaimView:
    """The claim as the preparer needs it. A malformed allocation result (a consumed capacity
    that is not a quantity) raises ``ClaimResultError`` naming the field."""
    meta = obj.get("metadata", {})
    allocation = (obj.get("status") or {}).get("allocation") or {}
    devices = allocation.get("devices") or {}
    results: Sequence[Mapping[str, Any]] = devices.get("results") or []
    return ClaimView(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        allocated=bool(allocation),
        devices=tuple(
            parse_allocated_device(r, f"status.allocation.devices.results[{i}]")
            for i, r in enumerate(results)
        ),
        configs=tuple(devices.get("config") or []),
        pod_claim_name=(meta.get("annotations") or {}).get(POD_CLAIM_NAME_ANNOTATION) or None,
    )


class ApiClaimSource:
    """GETs each claim as plain JSON and keeps the object for the status writer, whose write
    then needs no read of its own."""

    def __init__(self, api: KubeApi, objects: ClaimObjects | None = None) -> None:
        self._api = api
        self._objects = objects

    def get(self, namespace: str, name: str) -> ClaimView | None:
        try:
            obj = self._api.get(claim_path(namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        if self._objects is not None:
            self._objects.remember(obj)
        return parse_claim(obj)


def claim_path(namespace: str, name: str, subresource: str = "") -> str:
    segments = ["apis", "resource.k8s.io", "v1", "namespaces", namespace, "resourceclaims", name]
    return path_of(*segments, *([subresource] if subresource else []))
