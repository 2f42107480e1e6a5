"""flexgpu's own DeviceTaintRules: the taints that keep new claims off a GPU being cleared.

One rule per device (a rule's ``deviceSelector`` names one driver/pool/device), labelled so
the controller finds its rules again after a restart or a change of leader, and annotated
with the claim it clears the GPU for. The API version is the first one the API server
serves: ``resource.k8s.io/v1`` from Kubernetes 1.37 (``DRADeviceTaintRules`` GA, on),
``v1beta2`` on 1.36 and ``v1alpha3`` on 1.34/1.35 where an admin enabled them (the gate and
``--runtime-config``); none served means steering is off, said once in the log.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kubernetes import client

from flexgpu.driver.allocation.state import DeviceId

log = logging.getLogger(__name__)

GROUP: Final = "resource.k8s.io"
PLURAL: Final = "devicetaintrules"
VERSIONS: Final = ("v1", "v1beta2", "v1alpha3")
TAINT_KEY: Final = "flexgpu.dev/clearing"
MANAGED_LABEL: Final = "flexgpu.dev/clearing"  # value: MANAGED_VALUE
MANAGED_VALUE: Final = "true"
CLAIM_LABEL: Final = "flexgpu.dev/clearing-claim"  # value: a digest of the claim's uid
CLAIM_ANNOTATION: Final = "flexgpu.dev/clearing-for"  # namespace/name of the waiting claim
UID_ANNOTATION: Final = "flexgpu.dev/clearing-claim-uid"
GPU_ANNOTATION: Final = "flexgpu.dev/clearing-gpu"  # node/pool/gpu uuid
SINCE_ANNOTATION: Final = "flexgpu.dev/clearing-since"  # RFC 3339 time steering started
HTTP_NOT_FOUND: Final = 404
HTTP_CONFLICT: Final = 409


def _digest(text: str, size: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


def rule_name(claim_uid: str, device: DeviceId) -> str:
    return f"flexgpu-clearing-{_digest(claim_uid + chr(0) + '/'.join(device), 20)}"


@dataclass(frozen=True)
class ClearingFor:
    """What every rule of one clearing carries: the waiting claim and the GPU."""

    claim_uid: str
    claim: str  # namespace/name
    gpu: str  # node/pool/uuid
    since: str  # RFC 3339


@dataclass(frozen=True)
class RuleInfo:
    """One of our rules as listed: what the controller needs to take it over."""

    name: str
    claim_uid: str
    claim: str  # namespace/name
    gpu: str  # node/pool/uuid
    since: str


def rule_body(version: str, what: ClearingFor, device: DeviceId) -> dict[str, Any]:
    driver, pool, name = device
    claim_uid = what.claim_uid
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(claim_uid, device),
            "labels": {MANAGED_LABEL: MANAGED_VALUE, CLAIM_LABEL: _digest(claim_uid, 40)},
            "annotations": {
                CLAIM_ANNOTATION: what.claim,
                UID_ANNOTATION: claim_uid,
                GPU_ANNOTATION: what.gpu,
                SINCE_ANNOTATION: what.since,
            },
        },
        "spec": {
            "deviceSelector": {"driver": driver, "pool": pool, "device": name},
            # A label value: the claim is named in the annotations, the value only tells
            # rules for different claims apart.
            "taint": {"key": TAINT_KEY, "value": _digest(claim_uid, 40), "effect": "NoSchedule"},
        },
    }


def _info(obj: Mapping[str, Any]) -> RuleInfo | None:
    meta = obj.get("metadata") or {}
    notes = meta.get("annotations") or {}
    uid = notes.get(UID_ANNOTATION)
    if not uid:
        return None
    return RuleInfo(
        name=str(meta.get("name", "")),
        claim_uid=str(uid),
        claim=str(notes.get(CLAIM_ANNOTATION, "")),
        gpu=str(notes.get(GPU_ANNOTATION, "")),
        since=str(notes.get(SINCE_ANNOTATION, "")),
    )


class TaintRules:
    """Creates, lists and deletes flexgpu's clearing rules through the API server."""

    def __init__(self, api: client.ApiClient) -> None:
        self._objects = client.CustomObjectsApi(api)
        self._version: str | None = None
        self._probed = False

    def version(self) -> str | None:
        """The served API version of DeviceTaintRules (probed once), None when none is."""
        if not self._probed:
            for version in VERSIONS:
                try:
                    self._objects.list_cluster_custom_object(GROUP, version, PLURAL, limit=1)
                except client.ApiException as err:
                    if err.status == HTTP_NOT_FOUND:
                        continue
                    raise
                self._version = version
                break
            self._probed = True
            if self._version is None:
                log.warning(
                    "the API server serves no DeviceTaintRules (%s); GPU clearing is off",
                    ", ".join(f"{GROUP}/{v}" for v in VERSIONS),
                )
        return self._version

    def list(self) -> list[RuleInfo]:
        version = self.version()
        if version is None:
            return []
        listed: Any = self._objects.list_cluster_custom_object(
            GROUP, version, PLURAL, label_selector=f"{MANAGED_LABEL}={MANAGED_VALUE}"
        )
        infos = (_info(item) for item in listed.get("items", []))
        return [info for info in infos if info is not None]

    def create(self, what: ClearingFor, device: DeviceId) -> str:
        """Creates the rule (an existing one of the same name is ours already); its name."""
        version = self.version()
        if version is None:
            raise RuntimeError("no DeviceTaintRule API is served")
        body = rule_body(version, what, device)
        try:
            self._objects.create_cluster_custom_object(GROUP, version, PLURAL, body)
        except client.ApiException as err:
            if err.status != HTTP_CONFLICT:
                raise
        return str(body["metadata"]["name"])

    def delete(self, name: str) -> None:
        version = self.version()
        if version is None:
            return
        try:
            self._objects.delete_cluster_custom_object(GROUP, version, PLURAL, name)
        except client.ApiException as err:
            if err.status != HTTP_NOT_FOUND:
                raise
