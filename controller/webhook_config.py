"""The ``ValidatingWebhookConfiguration`` of flexgpu (``flexgpu-validation``), built and applied
by the controller itself (not by kopf's ``settings.admission.managed``, which hard-codes
``failurePolicy``, a 30 s timeout and has no ``matchConditions``).

Four webhooks, one per resource; each URL ends in the kopf handler id
(``controller.admission``), so a request runs exactly one handler:

================================  =========  =======  =============================================
webhook                           failure    timeout  sent to the webhook (``matchConditions``)
================================  =========  =======  =============================================
resourceclaims.gpu.flexgpu.dev    Ignore     3 s      a config with ``opaque.driver ==
resourceclaimtemplates.…          Ignore     3 s      'gpu.flexgpu.dev'`` (or ``gpu.nvidia.com``
deviceclasses.gpu.flexgpu.dev     Ignore     3 s      beside a request of a ``*.flexgpu.dev``
                                                      class), and on UPDATE only if the spec
                                                      changed and it is not being deleted
gpunodepolicies.flexgpu.dev       Fail       10 s     on UPDATE only if the spec changed
================================  =========  =======  =============================================

Why:

* A controller outage must never block claims. ``matchConditions`` (CEL, GA since 1.30) are
  evaluated by the apiserver itself, so a claim of another driver, or one of ours without an
  opaque config for ``gpu.flexgpu.dev``, is never sent to the webhook and is admitted whether
  or not the controller runs. Claims are also created by kube-controller-manager from
  templates for every pod; blocking those on our controller would stop GPU workloads that
  the kubelet plugin could serve on its own.
* Even claims *with* our config are ``Ignore`` with a short timeout: admission is early
  feedback, not the enforcement point. The kubelet plugin's prepare runs the very same
  validation and refuses a bad config with the same message (as a pod event), so a config
  that slips through during an outage still cannot take effect. A hung webhook costs at most
  3 s per claim creation.
* GpuNodePolicies are our own, admin-written, rarely changed CRD; an invalid one would make
  nodes reconfigure GPUs (maybe destroy MIG devices) on something nobody checked, so they are
  ``Fail``: while the controller is down, policy *spec* edits wait. Metadata-only updates
  (labels, finalizers) and deletes are never sent, so cleanup works during an outage.
* ``namespaceSelector`` lets a namespace opt out with the label ``flexgpu.dev/webhook:
  disabled`` (namespaced resources only; the apiserver ignores it for cluster-scoped ones).
* ``matchPolicy: Equivalent``: claims written through ``v1beta1``/``v1beta2`` are converted
  to ``v1`` and checked too.
* ``sideEffects: None``: the handlers only read the object, so dry-run requests are checked.

A matchCondition that errors (it should not: every field access is guarded with ``has``)
follows the webhook's failure policy.

Client config: ``ServiceRef`` (in-cluster: ``<name>.<namespace>.svc:<port>``) or a URL
(``https://127.0.0.1:PORT``, the local test world where the controller is a local process).
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from flexgpu.controller.admission import (
    CLAIMS_HANDLER,
    DEVICE_CLASSES_HANDLER,
    POLICIES_HANDLER,
    RESOURCE_GROUP,
    RESOURCE_VERSION,
    TEMPLATES_HANDLER,
)
from flexgpu.controller.config_addressing import MIGRATED_DRIVERS, OUR_CLASS_SUFFIX
from flexgpu.driver.names import CRD_GROUP, DRIVER_NAME
from flexgpu.driver.node_policy import PLURAL as POLICY_PLURAL
from flexgpu.driver.node_policy import VERSION as POLICY_VERSION

logger = logging.getLogger(__name__)

CONFIGURATION_NAME: Final = "flexgpu-validation"
OPT_OUT_LABEL: Final = "flexgpu.dev/webhook"
DEFAULT_NAMESPACE_SELECTOR: Final[dict[str, Any]] = {
    "matchExpressions": [{"key": OPT_OUT_LABEL, "operator": "NotIn", "values": ["disabled"]}]
}
CLAIM_TIMEOUT_S: Final = 3
POLICY_TIMEOUT_S: Final = 10
_CONFLICT_RETRIES: Final = 8

FailurePolicy: TypeAlias = Literal["Ignore", "Fail"]
ConfigurationKind: TypeAlias = Literal["validating", "mutating"]
_KINDS: Final[dict[str, ConfigurationKind]] = {
    "ValidatingWebhookConfiguration": "validating",
    "MutatingWebhookConfiguration": "mutating",
}


def _call(admission: Any, verb: str, kind: ConfigurationKind, *args: Any) -> Any:
    """``admission.<verb>_<kind>_webhook_configuration(*args)`` of AdmissionregistrationV1Api."""
    return getattr(admission, f"{verb}_{kind}_webhook_configuration")(*args)


@dataclass(frozen=True)
class ServiceRef:
    """The webhook's in-cluster Service; ``path`` is the server's root path."""

    namespace: str
    name: str
    port: int = 443
    path: str = ""


ClientTarget: TypeAlias = ServiceRef | str  # a ServiceRef, or an https:// URL (root)


def _mentions_driver(config_list: str) -> str:
    return (
        f"{config_list}.exists(c, has(c.opaque) && has(c.opaque.driver) && "
        f"c.opaque.driver == '{DRIVER_NAME}')"
    )


def _ours_or_misaddressed(devices: str) -> str:
    """A config for our driver, or NVIDIA's driver name on a claim with a request of one of
    our classes (``controller.config_addressing``: no driver would read that config)."""
    suffix = OUR_CLASS_SUFFIX
    our_request = (
        f"has({devices}.requests) && {devices}.requests.exists(r, "
        f"(has(r.exactly) && has(r.exactly.deviceClassName) && "
        f"r.exactly.deviceClassName.endsWith('{suffix}')) || "
        f"(has(r.firstAvailable) && r.firstAvailable.exists(s, has(s.deviceClassName) && "
        f"s.deviceClassName.endsWith('{suffix}'))))"
    )
    migrated = " || ".join(f"c.opaque.driver == '{d}'" for d in sorted(MIGRATED_DRIVERS))
    return (
        f"has({devices}.config) && {devices}.config.exists(c, has(c.opaque) && "
        f"has(c.opaque.driver) && (c.opaque.driver == '{DRIVER_NAME}' || "
        f"(({migrated}) && {our_request})))"
    )


# CEL over the v1 objects; `has()` guards every optional field so no condition can error.
CLAIM_CONDITION: Final = "has(object.spec.devices) && " + _ours_or_misaddressed(
    "object.spec.devices"
)
TEMPLATE_CONDITION: Final = (
    "has(object.spec.spec) && has(object.spec.spec.devices) && "
    + _ours_or_misaddressed("object.spec.spec.devices")
)
DEVICE_CLASS_CONDITION: Final = "has(object.spec.config) && " + _mentions_driver(
    "object.spec.config"
)
# UPDATEs matter only when the checked content changed; an object being deleted is let be.
CHANGED_CONDITION: Final = (
    "request.operation == 'CREATE' || "
    "(!has(object.metadata.deletionTimestamp) && "
    "(!has(oldObject.spec) || !has(object.spec) || oldObject.spec != object.spec))"
)


def client_config(target: ClientTarget, handler_id: str, ca_bundle: bytes | None) -> Any:
    config: dict[str, Any]
    if isinstance(target, ServiceRef):
        config = {
            "service": {
                "namespace": target.namespace,
                "name": target.name,
                "port": target.port,
                "path": f"{target.path.rstrip('/')}/{handler_id}",
            }
        }
    else:
        if not target.startswith("https://"):
            raise ValueError(f"webhook URL must start with https://, not {target!r}")
        config = {"url": f"{target.rstrip('/')}/{handler_id}"}
    if ca_bundle is not None:
        config["caBundle"] = base64.b64encode(ca_bundle).decode("ascii")
    return config


@dataclass(frozen=True)
class _Hook:
    """What differs between the webhooks."""

    name: str
    handler_id: str
    rule: dict[str, Any]
    conditions: dict[str, str]
    failure_policy: FailurePolicy
    timeout_s: int
    namespace_selector: dict[str, Any] | None


def _webhook(
    hook: _Hook,
    *,
    target: ClientTarget,
    ca_bundle: bytes | None,
    object_selector: dict[str, Any] | None,
) -> dict[str, Any]:
    webhook: dict[str, Any] = {
        "name": hook.name,
        "clientConfig": client_config(target, hook.handler_id, ca_bundle),
        "rules": [{"operations": ["CREATE", "UPDATE"], **hook.rule}],
        "failurePolicy": hook.failure_policy,
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": hook.timeout_s,
        "admissionReviewVersions": ["v1"],
        "matchConditions": [
            {"name": key, "expression": cel} for key, cel in hook.conditions.items()
        ],
    }
    if hook.namespace_selector is not None:
        webhook["namespaceSelector"] = hook.namespace_selector
    if object_selector is not None:
        webhook["objectSelector"] = object_selector
    return webhook


def build_webhook_configuration(
    target: ClientTarget,
    ca_bundle: bytes | None,
    *,
    name: str = CONFIGURATION_NAME,
    namespace_selector: dict[str, Any] | None = DEFAULT_NAMESPACE_SELECTOR,
    object_selector: dict[str, Any] | None = None,
    claim_timeout_s: int = CLAIM_TIMEOUT_S,
    claim_failure_policy: FailurePolicy = "Ignore",
    policy_timeout_s: int = POLICY_TIMEOUT_S,
    policy_failure_policy: FailurePolicy = "Fail",
) -> dict[str, Any]:
    """The ValidatingWebhookConfiguration as a JSON-ready dict (see the module docstring).

    ``ca_bundle`` is PEM; ``None`` leaves ``caBundle`` unset (``apply_webhook_configuration``
    then keeps whatever is there, e.g. injected by cert-manager's cainjector).
    """
    resource_rule = {"apiGroups": [RESOURCE_GROUP], "apiVersions": [RESOURCE_VERSION]}
    hooks = [
        _Hook(
            name=f"resourceclaims.{DRIVER_NAME}",
            handler_id=CLAIMS_HANDLER,
            rule={**resource_rule, "resources": ["resourceclaims"], "scope": "Namespaced"},
            conditions={"flexgpu-config": CLAIM_CONDITION, "changed": CHANGED_CONDITION},
            failure_policy=claim_failure_policy,
            timeout_s=claim_timeout_s,
            namespace_selector=namespace_selector,
        ),
        _Hook(
            name=f"resourceclaimtemplates.{DRIVER_NAME}",
            handler_id=TEMPLATES_HANDLER,
            rule={**resource_rule, "resources": ["resourceclaimtemplates"], "scope": "Namespaced"},
            conditions={"flexgpu-config": TEMPLATE_CONDITION, "changed": CHANGED_CONDITION},
            failure_policy=claim_failure_policy,
            timeout_s=claim_timeout_s,
            namespace_selector=namespace_selector,
        ),
        _Hook(
            name=f"deviceclasses.{DRIVER_NAME}",
            handler_id=DEVICE_CLASSES_HANDLER,
            rule={**resource_rule, "resources": ["deviceclasses"], "scope": "Cluster"},
            conditions={"flexgpu-config": DEVICE_CLASS_CONDITION, "changed": CHANGED_CONDITION},
            failure_policy=claim_failure_policy,
            timeout_s=claim_timeout_s,
            namespace_selector=None,
        ),
        _Hook(
            name=f"{POLICY_PLURAL}.{CRD_GROUP}",
            handler_id=POLICIES_HANDLER,
            rule={
                "apiGroups": [CRD_GROUP],
                "apiVersions": [POLICY_VERSION],
                "resources": [POLICY_PLURAL],
                "scope": "Cluster",
            },
            conditions={"changed": CHANGED_CONDITION},
            failure_policy=policy_failure_policy,
            timeout_s=policy_timeout_s,
            namespace_selector=None,
        ),
    ]
    webhooks = [
        _webhook(hook, target=target, ca_bundle=ca_bundle, object_selector=object_selector)
        for hook in hooks
    ]
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/name": "flexgpu",
                "app.kubernetes.io/component": "webhook",
            },
        },
        "webhooks": webhooks,
    }


def _keep_ca_bundles(desired: dict[str, Any], existing: Any) -> None:
    """Where ``desired`` has no caBundle, keep the one the existing webhook of that name has."""
    present = {
        hook.name: hook.client_config.ca_bundle
        for hook in (existing.webhooks or [])
        if hook.client_config is not None and hook.client_config.ca_bundle
    }
    for hook in desired["webhooks"]:
        if "caBundle" not in hook["clientConfig"] and hook["name"] in present:
            hook["clientConfig"]["caBundle"] = present[hook["name"]]


def apply_webhook_configuration(admission: Any, body: dict[str, Any]) -> None:
    """Create or replace the configuration. ``admission`` is a
    ``kubernetes.client.AdmissionregistrationV1Api``. Replicas may race: a create that finds
    it exists, or a replace on a stale resourceVersion, reads again and retries."""
    from kubernetes.client.exceptions import ApiException

    name = body["metadata"]["name"]
    kind = _KINDS[body["kind"]]
    for _ in range(_CONFLICT_RETRIES):
        try:
            existing = _call(admission, "read", kind, name)
        except ApiException as error:
            if error.status != 404:
                raise
            try:
                _call(admission, "create", kind, body)
            except ApiException as create_error:
                if create_error.status == 409:
                    continue
                raise
            logger.info("created %s %s", body["kind"], name)
            return
        desired = {**body, "metadata": {**body["metadata"]}}
        desired["webhooks"] = [
            {**hook, "clientConfig": dict(hook["clientConfig"])} for hook in body["webhooks"]
        ]
        _keep_ca_bundles(desired, existing)
        desired["metadata"]["resourceVersion"] = existing.metadata.resource_version
        try:
            _call(admission, "replace", kind, name, desired)
        except ApiException as error:
            if error.status in (409, 404):
                continue
            raise
        logger.info("updated %s %s", body["kind"], name)
        return
    raise RuntimeError(f"{body['kind']} {name} kept changing; gave up")


def patch_ca_bundle(
    admission: Any, name: str, ca_bundle: bytes, kind: ConfigurationKind = "validating"
) -> None:
    """Set ``caBundle`` in every webhook of the configuration ``name`` that someone else (the
    Helm chart) installed, changing nothing else. A configuration that is not there is left
    absent: it was uninstalled, or webhook.enabled turned off, and must not come back."""
    from kubernetes.client.exceptions import ApiException

    shown = f"{kind.capitalize()}WebhookConfiguration"
    encoded = base64.b64encode(ca_bundle).decode("ascii")
    for _ in range(_CONFLICT_RETRIES):
        try:
            existing = _call(admission, "read", kind, name)
        except ApiException as error:
            if error.status == 404:
                logger.warning("%s %s is not installed", shown, name)
                return
            raise
        hooks = existing.webhooks or []
        if all(h.client_config is not None and h.client_config.ca_bundle == encoded for h in hooks):
            return
        # Guarded by the resourceVersion read: another replica's concurrent write fails the
        # test op (422) instead of being overwritten, and the loop reads again.
        version = existing.metadata.resource_version
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": version}
        ]
        ops += [
            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": encoded}
            for i in range(len(hooks))
        ]
        try:
            _call(admission, "patch", kind, name, ops)
        except ApiException as error:
            if error.status in (409, 422, 404):
                continue
            raise
        logger.info("caBundle of %s %s updated", shown, name)
        return
    raise RuntimeError(f"{shown} {name} kept changing; gave up")
