"""The reads the pod toleration webhook (gpu_tolerations.py) makes for one admission request:
a pod's ResourceClaims, ResourceClaimTemplates and the DeviceClasses they name, read from
the API server as they are now (a claim made a moment before the pod is seen; a cache could
miss it). Each object is read at most once per request. A missing object is ``None``; any
other API error raises, so the API server applies the webhook's failurePolicy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexgpu.controller.gpu_tolerations import ClaimLookup

__all__ = ["ApiClaimLookup"]

_GROUP, _VERSION = "resource.k8s.io", "v1"


class ApiClaimLookup(ClaimLookup):
    """``ClaimLookup`` over a ``kubernetes.client.ApiClient``; make one per request."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self._objects = client.CustomObjectsApi(api_client)
        self._seen: dict[tuple[str, str, str], Mapping[str, Any] | None] = {}

    def _read(self, plural: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        key = (plural, namespace, name)
        if key not in self._seen:
            try:
                if namespace:
                    obj = self._objects.get_namespaced_custom_object(
                        _GROUP, _VERSION, namespace, plural, name, _request_timeout=2
                    )
                else:
                    obj = self._objects.get_cluster_custom_object(
                        _GROUP, _VERSION, plural, name, _request_timeout=2
                    )
            except ApiException as error:
                if error.status != 404:
                    raise
                obj = None
            self._seen[key] = obj if isinstance(obj, Mapping) else None
        return self._seen[key]

    def claim_spec(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        claim = self._read("resourceclaims", namespace, name)
        return None if claim is None else claim.get("spec") or {}

    def template_claim_spec(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        template = self._read("resourceclaimtemplates", namespace, name)
        if template is None:
            return None
        return (template.get("spec") or {}).get("spec") or {}

    def device_class_spec(self, name: str) -> Mapping[str, Any] | None:
        device_class = self._read("deviceclasses", "", name)
        return None if device_class is None else device_class.get("spec") or {}
