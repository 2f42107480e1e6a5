"""Reads ResourceClaims from the API server as plain data the preparer understands."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes import client


@dataclass(frozen=True)
class AllocatedDevice:
    """One entry of ``status.allocation.devices.results``."""

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed_capacity: Mapping[str, str] = field(default_factory=dict)

    @property
    def base_request(self) -> str:
        """``gpu/h100`` (a firstAvailable subrequest) -> ``gpu``: what the kubelet matches."""
        return self.request.split("/", 1)[0]


@dataclass(frozen=True)
class ClaimView:
    uid: str
    namespace: str
    name: str
    allocated: bool
    devices: tuple[AllocatedDevice, ...] = ()
    # ``status.allocation.devices.config`` entries, class configs first as the API orders them.
    configs: tuple[Mapping[str, Any], ...] = ()


class ClaimSource(Protocol):
    def get(self, namespace: str, name: str) -> ClaimView | None:
        """The claim, or None when it does not exist."""


def parse_claim(obj: Mapping[str, Any]) -> ClaimView:
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
            AllocatedDevice(
                request=str(r.get("request", "")),
                driver=str(r.get("driver", "")),
                pool=str(r.get("pool", "")),
                device=str(r.get("device", "")),
                admin_access=bool(r.get("adminAccess", False)),
                share_id=r.get("shareID"),
                consumed_capacity=dict(r.get("consumedCapacity") or {}),
            )
            for r in results
        ),
        configs=tuple(devices.get("config") or []),
    )


class ApiClaimSource:
    """GETs each claim; raw JSON avoids the client's model round trip on the prepare path."""

    def __init__(self, api: Any) -> None:
        self._resource = client.ResourceV1Api(api)

    def get(self, namespace: str, name: str) -> ClaimView | None:
        try:
            response: Any = self._resource.read_namespaced_resource_claim(
                name, namespace, _preload_content=False
            )
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise
        return parse_claim(json.loads(response.data))
