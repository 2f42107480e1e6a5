"""flexgpu's own DeviceTaintRules: the taints that keep new claims off a GPU being cleared
(``controller.clearing``) or off a node being let empty (``controller.node_steering``).

GPU clearing: one rule per device (a rule's ``deviceSelector`` names one driver/pool/device:
the device the waiting claim will take stays untainted), annotated with that claim. Node
steering: one rule per pool of flexgpu's driver on the node (the selector names driver and
pool, no device), so partitions published later are covered too and one delete ends it; its
taint key is ``flexgpu.dev/node-steering`` and it carries ``STEERING_LABEL``, so the two kinds
are told apart when listed. Every rule is labelled so the controller finds its rules again
after a restart or a change of leader. The API version is the first one the API server
serves: ``resource.k8s.io/v1`` from Kubernetes 1.37 (``DRADeviceTaintRules`` GA, on),
``v1beta2`` on 1.36 and ``v1alpha3`` on 1.34/1.35 where an admin enabled them (the gate and
``--runtime-config``); none served means steering is off, said once in the log.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
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
STEERING_TAINT_KEY: Final = "flexgpu.dev/node-steering"
STEERING_LABEL: Final = "flexgpu.dev/node-steering"  # value: MANAGED_VALUE
STEERING_NODE_ANNOTATION: Final = "flexgpu.dev/node-steering-node"
STEERING_SINCE_ANNOTATION: Final = "flexgpu.dev/node-steering-since"  # RFC 3339
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


@dataclass(frozen=True)
class SteeringFor:
    """What every rule of one node's steering carries."""

    node: str
    since: str  # RFC 3339


@dataclass(frozen=True)
class SteeringRule:
    """One node steering rule as listed."""

    name: str
    node: str
    since: str


def steering_rule_name(driver: str, pool: str) -> str:
    return f"flexgpu-node-steering-{_digest(driver + chr(0) + pool, 20)}"


def steering_rule_body(version: str, what: SteeringFor, driver: str, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": steering_rule_name(driver, pool),
            "labels": {MANAGED_LABEL: MANAGED_VALUE, STEERING_LABEL: MANAGED_VALUE},
            "annotations": {
                STEERING_NODE_ANNOTATION: what.node,
                STEERING_SINCE_ANNOTATION: what.since,
            },
        },
        "spec": {
            # No device: every device of the pool, including ones published later.
            "deviceSelector": {"driver": driver, "pool": pool},
            "taint": {"key": STEERING_TAINT_KEY, "effect": "NoSchedule"},
        },
    }


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


def _steering_info(obj: Mapping[str, Any]) -> SteeringRule | None:
    meta = obj.get("metadata") or {}
    notes = meta.get("annotations") or {}
    node = notes.get(STEERING_NODE_ANNOTATION)
    if not node:
        return None
    return SteeringRule(
        name=str(meta.get("name", "")),
        node=str(node),
        since=str(notes.get(STEERING_SINCE_ANNOTATION, "")),
    )


class TaintRules:
    """Creates, lists and deletes flexgpu's rules (both kinds) through the API server."""

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
                    "the API server serves no DeviceTaintRules (%s); GPU clearing and node "
                    "steering are off",
                    ", ".join(f"{GROUP}/{v}" for v in VERSIONS),
                )
        return self._version

    def _list(self, selector: str) -> list[Mapping[str, Any]]:
        version = self.version()
        if version is None:
            return []
        listed: Any = self._objects.list_cluster_custom_object(
            GROUP, version, PLURAL, label_selector=selector
        )
        return list(listed.get("items", []))

    def list_steering(self) -> list[SteeringRule]:
        items = self._list(f"{MANAGED_LABEL}={MANAGED_VALUE},{STEERING_LABEL}={MANAGED_VALUE}")
        infos = (_steering_info(item) for item in items)
        return [info for info in infos if info is not None]

    def list(self) -> list[RuleInfo]:
        """GPU clearing's rules (rules from before node steering existed have no
        STEERING_LABEL, hence the negative selector)."""
        items = self._list(f"{MANAGED_LABEL}={MANAGED_VALUE},!{STEERING_LABEL}")
        infos = (_info(item) for item in items)
        return [info for info in infos if info is not None]

    def create(self, what: ClearingFor, device: DeviceId) -> str:
        """Creates a clearing rule (an existing one of the same name is ours already); its
        name."""
        return self._create(lambda version: rule_body(version, what, device))

    def steer(self, what: SteeringFor, driver: str, pool: str) -> str:
        """Creates a node steering rule for one pool; its name."""
        return self._create(lambda version: steering_rule_body(version, what, driver, pool))

    def _create(self, make: Callable[[str], dict[str, Any]]) -> str:
        version = self.version()
        if version is None:
            raise RuntimeError("no DeviceTaintRule API is served")
        body = make(version)
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
