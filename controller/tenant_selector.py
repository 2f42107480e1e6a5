"""Mutating admission for shared GPUs: every request for a shared GPU asks for one that is
free or already serves the claim's namespace.

A shared GPU serves one namespace at a time (kubelet_plugin/claims/tenancy.py refuses the mix in
prepare). The plugin publishes each shared GPU's namespace as the attribute ``tenant`` ("" while
free; kubelet_plugin/claims/tenant_attribute.py). This webhook adds, to every request and
``firstAvailable`` subrequest of a ResourceClaim or ResourceClaimTemplate whose
``deviceClassName`` is ``shared-gpu.flexgpu.dev``, the selector::

    !("tenant" in device.attributes["gpu.flexgpu.dev"]) ||
        device.attributes["gpu.flexgpu.dev"].tenant in ["", "<namespace>"]

so the scheduler passes over a GPU that serves another namespace. Selectors of a request are
ANDed, so a selector the user wrote can narrow this one but never widen it: a claim cannot ask
for another namespace's GPU, and cannot opt out. The namespace is the admission request's, never
a field of the object. A device without the attribute (a plugin of an older version, or one
told that namespaces may share) matches, so the selector never makes a claim fail with a CEL
error; prepare's guard still decides there.

Idempotent: a request that already has this exact selector gets no second one, so the
apiserver's reinvocation and claims created from mutated templates change nothing. Pure: no I/O.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any, Final

from flexgpu.driver.names import DRIVER_NAME, SHARED_GPU_DEVICE_CLASS, TENANT_ATTRIBUTE

__all__ = [
    "TENANT_CLAIMS_HANDLER",
    "TENANT_HANDLERS",
    "TENANT_TEMPLATES_HANDLER",
    "answer_tenant_review",
    "tenant_expression",
    "tenant_patch",
]

# Handler ids, the last URL path segment of each mutating webhook.
TENANT_CLAIMS_HANDLER: Final = "tenancy-resourceclaims"
TENANT_TEMPLATES_HANDLER: Final = "tenancy-resourceclaimtemplates"
# handler id -> (group, version, plural, JSON pointer of the claim spec in the object)
TENANT_HANDLERS: Final[dict[str, tuple[str, str, str, str]]] = {
    TENANT_CLAIMS_HANDLER: ("resource.k8s.io", "v1", "resourceclaims", "/spec"),
    TENANT_TEMPLATES_HANDLER: ("resource.k8s.io", "v1", "resourceclaimtemplates", "/spec/spec"),
}


def tenant_expression(namespace: str) -> str:
    """The CEL selector that keeps a request of ``namespace`` off GPUs serving another."""
    attributes = f"device.attributes[{json.dumps(DRIVER_NAME)}]"
    name = json.dumps(TENANT_ATTRIBUTE)
    return (
        f"!({name} in {attributes}) || "
        f'{attributes}.{TENANT_ATTRIBUTE} in ["", {json.dumps(namespace)}]'
    )


def _mapping(value: object) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def _selector_ops(request: Mapping[str, Any], path: str, selector: dict[str, Any]) -> list[Any]:
    """The ops adding ``selector`` to one (sub)request at ``path`` if it is for a shared GPU
    and lacks it."""
    if request.get("deviceClassName") != SHARED_GPU_DEVICE_CLASS:
        return []
    selectors = request.get("selectors")
    if not isinstance(selectors, list):
        return [{"op": "add", "path": f"{path}/selectors", "value": [selector]}]
    if selector in selectors:
        return []
    return [{"op": "add", "path": f"{path}/selectors/-", "value": selector}]


def tenant_patch(spec: object, namespace: str, spec_path: str = "/spec") -> list[Any]:
    """JSON patch ops (RFC 6902) adding the tenant selector to every shared-GPU request of
    the claim ``spec`` (found at ``spec_path`` in the object); [] when none needs it."""
    selector = {"cel": {"expression": tenant_expression(namespace)}}
    devices = _mapping((_mapping(spec) or {}).get("devices"))
    requests = devices.get("requests") if devices else None
    if not isinstance(requests, list):
        return []
    ops: list[Any] = []
    for i, item in enumerate(requests):
        request = _mapping(item) or {}
        base = f"{spec_path}/devices/requests/{i}"
        exactly = _mapping(request.get("exactly"))
        if exactly is not None:
            ops += _selector_ops(exactly, f"{base}/exactly", selector)
        alternatives = request.get("firstAvailable")
        if isinstance(alternatives, list):
            for j, sub in enumerate(alternatives):
                if _mapping(sub) is not None:
                    ops += _selector_ops(sub, f"{base}/firstAvailable/{j}", selector)
    return ops


def _spec_at(obj: Mapping[str, Any], pointer: str) -> object:
    value: object = obj
    for key in pointer.strip("/").split("/"):
        value = (_mapping(value) or {}).get(key)
    return value


def answer_tenant_review(
    handler_id: str, admission_review: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The AdmissionReview response: allowed, with a JSONPatch when a request needed the
    selector; ``None`` when the review is not for the resource ``handler_id`` serves."""
    request = _mapping(admission_review.get("request")) or {}
    resource = _mapping(request.get("resource")) or {}
    group, version, plural, pointer = TENANT_HANDLERS[handler_id]
    key = (resource.get("group"), resource.get("version"), resource.get("resource"))
    if key != (group, version, plural) or request.get("subResource"):
        return None
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    obj = _mapping(request.get("object"))
    namespace = request.get("namespace")
    if request.get("operation") == "CREATE" and obj is not None and isinstance(namespace, str):
        ops = tenant_patch(_spec_at(obj, pointer), namespace, pointer)
        if ops:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode("ascii")
    return {
        "apiVersion": admission_review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": admission_review.get("kind", "AdmissionReview"),
        "response": response,
    }
