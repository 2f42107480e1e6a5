"""Mutating admission for pods: a pod whose ResourceClaims or ResourceClaimTemplates ask
flexgpu for devices gets the GPU-node tolerations the admin named, as Kubernetes'
ExtendedResourceToleration admission plugin does for pods that ask for an extended resource.

GPU nodes usually carry a taint (``nvidia.com/gpu:NoSchedule`` is the common one) so that pods
without GPUs stay off them. A pod that asks for a GPU through a claim names no extended
resource, so ExtendedResourceToleration adds nothing, and without this webhook every such pod
had to carry the toleration by hand.

Which pods: those whose ``spec.resourceClaims`` name a claim or a template with a request (or
``firstAvailable`` subrequest) of a DeviceClass that selects flexgpu's devices, a request whose
own selectors do, or an opaque config for ``gpu.flexgpu.dev``. A class selects flexgpu's
devices when one of its CEL selectors compares ``device.driver`` with ``gpu.flexgpu.dev``, as
every class of the chart does. The lookups are done through ``ClaimLookup`` (the API reads are
in ``pod_claim_lookup.py``); this module is pure.

Idempotent: a toleration already on the pod with the same key, operator, value and effect is
not added again (its ``tolerationSeconds`` is left as the pod has it), so reinvocation and a
toleration written by hand change nothing.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from typing import Any, Final, Protocol

from flexgpu.driver.names import DRIVER_NAME

__all__ = [
    "DEFAULT_GPU_TOLERATIONS",
    "GPU_TOLERATIONS_HANDLER",
    "ClaimLookup",
    "TolerationError",
    "answer_toleration_review",
    "class_selects_flexgpu",
    "parse_tolerations",
    "pod_uses_flexgpu",
    "spec_uses_flexgpu",
    "toleration_patch",
]

# The handler id: the last URL path segment of the pod webhook.
GPU_TOLERATIONS_HANDLER: Final = "gpu-tolerations-pods"
# The taint GPU nodes most often carry (cloud GPU node pools, NVIDIA's docs).
DEFAULT_GPU_TOLERATIONS: Final[tuple[dict[str, str], ...]] = (
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
)
OPERATORS: Final = ("Exists", "Equal")
EFFECTS: Final = ("NoSchedule", "PreferNoSchedule", "NoExecute", "")
_FIELDS: Final = ("key", "operator", "value", "effect", "tolerationSeconds")
# `device.driver == "gpu.flexgpu.dev"` in either order and either quote style.
_DRIVER_TEST: Final = re.compile(
    r"device\.driver\s*==\s*(['\"])" + re.escape(DRIVER_NAME) + r"\1"
    r"|(['\"])" + re.escape(DRIVER_NAME) + r"\2\s*==\s*device\.driver"
)


class TolerationError(ValueError):
    """A toleration the admin wrote is not one Kubernetes accepts."""


class ClaimLookup(Protocol):
    """Reads for one admission request; each returns None when the object does not exist."""

    def claim_spec(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...

    def template_claim_spec(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...

    def device_class_spec(self, name: str) -> Mapping[str, Any] | None: ...


def parse_tolerations(value: object, where: str = "tolerations") -> list[dict[str, Any]]:
    """The admin's tolerations, checked as the API server checks a pod's: a list of objects
    with ``key``, ``operator`` (Exists or Equal, no ``value`` with Exists), ``value``,
    ``effect`` and ``tolerationSeconds`` (NoExecute only)."""
    if not isinstance(value, list):
        raise TolerationError(f"{where}: {value!r} is not allowed; allowed: a list of tolerations")
    parsed: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise TolerationError(f"{at}: {item!r} is not allowed; allowed: an object")
        unknown = sorted(set(item) - set(_FIELDS))
        if unknown:
            raise TolerationError(
                f"{at}.{unknown[0]}: unknown field; allowed: {', '.join(_FIELDS)}"
            )
        key, operator = item.get("key", ""), item.get("operator", "Equal")
        value_, effect = item.get("value", ""), item.get("effect", "")
        if not isinstance(key, str) or not key:
            raise TolerationError(
                f"{at}.key: {key!r} is not allowed; allowed: a taint key such as nvidia.com/gpu"
            )
        if operator not in OPERATORS:
            raise TolerationError(
                f"{at}.operator: {operator!r} is not allowed; allowed: {', '.join(OPERATORS)}"
            )
        if not isinstance(value_, str) or (operator == "Exists" and value_):
            raise TolerationError(
                f"{at}.value: {value_!r} is not allowed; allowed: a string, empty with Exists"
            )
        if effect not in EFFECTS:
            allowed = ", ".join(repr(e) for e in EFFECTS)
            raise TolerationError(f"{at}.effect: {effect!r} is not allowed; allowed: {allowed}")
        seconds = item.get("tolerationSeconds")
        if seconds is not None and (
            effect != "NoExecute" or not isinstance(seconds, int) or isinstance(seconds, bool)
        ):
            raise TolerationError(
                f"{at}.tolerationSeconds: {seconds!r} is not allowed; allowed: whole seconds, "
                "with effect NoExecute only"
            )
        toleration: dict[str, Any] = {"key": key, "operator": operator}
        if value_:
            toleration["value"] = value_
        if effect:
            toleration["effect"] = effect
        if seconds is not None:
            toleration["tolerationSeconds"] = seconds
        parsed.append(toleration)
    return parsed


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _selectors_name_flexgpu(selectors: object) -> bool:
    return any(
        _DRIVER_TEST.search(str(_mapping(_mapping(s).get("cel")).get("expression", "")))
        for s in _list(selectors)
    )


def _configs_name_flexgpu(configs: object) -> bool:
    return any(
        _mapping(_mapping(c).get("opaque")).get("driver") == DRIVER_NAME for c in _list(configs)
    )


def class_selects_flexgpu(spec: Mapping[str, Any]) -> bool:
    """Whether a DeviceClass's spec asks for flexgpu's devices (or carries its config)."""
    return _selectors_name_flexgpu(spec.get("selectors")) or _configs_name_flexgpu(
        spec.get("config")
    )


def spec_uses_flexgpu(spec: Mapping[str, Any], lookup: ClaimLookup) -> bool:
    """Whether a claim spec has a request that flexgpu serves."""
    devices = _mapping(spec.get("devices"))
    if _configs_name_flexgpu(devices.get("config")):
        return True
    classes: set[str] = set()
    for item in _list(devices.get("requests")):
        request = _mapping(item)
        alternatives = map(_mapping, _list(request.get("firstAvailable")))
        for one in [_mapping(request.get("exactly")), *alternatives]:
            if _selectors_name_flexgpu(one.get("selectors")):
                return True
            name = one.get("deviceClassName")
            if isinstance(name, str) and name:
                classes.add(name)
    for name in sorted(classes):
        class_spec = lookup.device_class_spec(name)
        if class_spec is not None and class_selects_flexgpu(class_spec):
            return True
    return False


def pod_uses_flexgpu(pod: Mapping[str, Any], namespace: str, lookup: ClaimLookup) -> bool:
    """Whether one of the pod's claims (named, or made from a template) asks flexgpu for
    devices. A claim or template that does not exist (yet) counts as not flexgpu's: the
    scheduler then reports the taint, and the pod can be created again."""
    for item in _list(_mapping(pod.get("spec")).get("resourceClaims")):
        entry = _mapping(item)
        spec: Mapping[str, Any] | None = None
        if isinstance(entry.get("resourceClaimName"), str):
            spec = lookup.claim_spec(namespace, entry["resourceClaimName"])
        elif isinstance(entry.get("resourceClaimTemplateName"), str):
            spec = lookup.template_claim_spec(namespace, entry["resourceClaimTemplateName"])
        if spec is not None and spec_uses_flexgpu(spec, lookup):
            return True
    return False


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    def norm(t: Mapping[str, Any]) -> tuple[Any, ...]:
        return (
            t.get("key", ""),
            t.get("operator") or "Equal",
            t.get("value", ""),
            t.get("effect", ""),
        )

    return norm(a) == norm(b)


def toleration_patch(pod: Mapping[str, Any], tolerations: list[dict[str, Any]]) -> list[Any]:
    """JSON patch ops adding each of ``tolerations`` the pod lacks; [] when it has them all."""
    present = [_mapping(t) for t in _list(_mapping(pod.get("spec")).get("tolerations"))]
    missing: list[dict[str, Any]] = []
    for toleration in tolerations:
        if not any(_same(toleration, t) for t in [*present, *missing]):
            missing.append(toleration)
    if not missing:
        return []
    if "tolerations" not in _mapping(pod.get("spec")) or not isinstance(
        _mapping(pod.get("spec")).get("tolerations"), list
    ):
        return [{"op": "add", "path": "/spec/tolerations", "value": missing}]
    return [{"op": "add", "path": "/spec/tolerations/-", "value": t} for t in missing]


def answer_toleration_review(
    tolerations: list[dict[str, Any]],
    lookup: ClaimLookup,
    admission_review: Mapping[str, Any],
) -> dict[str, Any] | None:
    """The AdmissionReview response for a pod: allowed, with a JSONPatch adding the missing
    tolerations when the pod uses flexgpu; ``None`` when the review is not for pods. A failed
    lookup raises, so the API server applies the webhook's failurePolicy."""
    request = _mapping(admission_review.get("request"))
    resource = _mapping(request.get("resource"))
    key = (resource.get("group"), resource.get("version"), resource.get("resource"))
    if key != ("", "v1", "pods") or request.get("subResource"):
        return None
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    pod = _mapping(request.get("object"))
    namespace = request.get("namespace")
    if (
        request.get("operation") == "CREATE"
        and isinstance(namespace, str)
        and pod_uses_flexgpu(pod, namespace, lookup)
    ):
        ops = toleration_patch(pod, tolerations)
        if ops:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode("ascii")
    return {
        "apiVersion": admission_review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": admission_review.get("kind", "AdmissionReview"),
        "response": response,
    }
