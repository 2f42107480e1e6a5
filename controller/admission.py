"""Validating admission for flexgpu: the checks (pure functions) and the AdmissionReview answer.

What is checked, with the same code the kubelet plugin's prepare runs, so admission accepts
exactly what prepare accepts:

* ResourceClaims (``spec.devices.config``) and ResourceClaimTemplates
  (``spec.spec.devices.config``), ``resource.k8s.io/v1``: every opaque config addressed to
  ``gpu.flexgpu.dev`` is parsed (``driver.config_resolution.validate_config_entries`` →
  ``driver.opaque_config.parse_opaque_config``). When a request's ``deviceClassName`` is one of
  ours (``gpu.flexgpu.dev`` and ``shared-gpu.flexgpu.dev`` select GPUs, ``mig.flexgpu.dev`` MIG
  devices), a config naming that request must be of the matching kind, and the config
  prepare would pick for it must fit the device (a fraction's ``share.computeLimit`` not
  below the compute its request reserves, ``driver.config_support``).
* DeviceClasses (``spec.config``): the configs for our driver, as class configs.
* GpuNodePolicies (``flexgpu.dev/v1alpha1``): ``driver.node_policy.parse_node_policy``.

Configs for other drivers are ignored, except NVIDIA's (``gpu.nvidia.com``) on requests only
flexgpu serves, which no driver would read (``controller.config_addressing``); an object
without any of ours is allowed untouched.
Every problem is listed in the rejection, one per line, each naming its JSON path.

Updates are checked only when the checked part changed (a claim's spec is immutable; a label or
finalizer edit must never be refused because an older object fails a newer rule, or deletion
could hang). Objects being deleted are always allowed.

``answer_admission_review(review)`` answers one AdmissionReview; the webhook server, TLS and
the ValidatingWebhookConfiguration are in ``controller.webhook_server``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from flexgpu.controller.config_addressing import misaddressed_configs
from flexgpu.driver.config_resolution import (
    ConfigSource,
    DeviceType,
    request_compute_percents,
    request_device_counts,
    validate_config_entries,
)
from flexgpu.driver.names import (
    CRD_GROUP,
    DRIVER_NAME,
    GPU_DEVICE_CLASS,
    MIG_DEVICE_CLASS,
    SHARED_GPU_DEVICE_CLASS,
)
from flexgpu.driver.node_policy import PLURAL as POLICY_PLURAL
from flexgpu.driver.node_policy import VERSION as POLICY_VERSION
from flexgpu.driver.node_policy import NodePolicyError, parse_node_policy

RESOURCE_GROUP: Final = "resource.k8s.io"
RESOURCE_VERSION: Final = "v1"

# What each of our DeviceClasses selects, for the kind check of configs naming a request.
CLASS_DEVICE_TYPES: Final[dict[str, DeviceType]] = {
    GPU_DEVICE_CLASS: "gpu",
    SHARED_GPU_DEVICE_CLASS: "shared",
    MIG_DEVICE_CLASS: "mig",
}
# A rejection lists at most this many problems, then a count of the rest.
MAX_LISTED_PROBLEMS: Final = 20
# HTTP code of a rejection in the API error: the object is invalid (as apiserver validation).
REJECTION_CODE: Final = 422

# Handler ids: also the last URL path segment of each webhook (kopf routes by it).
CLAIMS_HANDLER: Final = "resourceclaims"
TEMPLATES_HANDLER: Final = "resourceclaimtemplates"
DEVICE_CLASSES_HANDLER: Final = "deviceclasses"
POLICIES_HANDLER: Final = "gpunodepolicies"

Problems = list[str]


# --------------------------------------------------------------------------- pure checks


def _mapping(value: object) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def request_device_types(requests: object) -> dict[str, DeviceType]:
    """Map each request reference (``gpu``, or ``main/sub`` for a ``firstAvailable``
    subrequest) whose DeviceClass is one of ours to the device type that class selects.

    ``requests`` is ``spec.devices.requests`` of a v1 claim; malformed parts are skipped (the
    apiserver's own validation reports them).
    """
    out: dict[str, DeviceType] = {}
    if not isinstance(requests, list | tuple):
        return out
    for raw in requests:
        request = _mapping(raw)
        if request is None or not isinstance(request.get("name"), str):
            continue
        name: str = request["name"]
        exactly = _mapping(request.get("exactly"))
        if exactly is not None:
            device_type = CLASS_DEVICE_TYPES.get(str(exactly.get("deviceClassName")))
            if device_type is not None:
                out[name] = device_type
        subrequests = request.get("firstAvailable")
        for raw_sub in subrequests if isinstance(subrequests, list | tuple) else ():
            sub = _mapping(raw_sub)
            if sub is None or not isinstance(sub.get("name"), str):
                continue
            device_type = CLASS_DEVICE_TYPES.get(str(sub.get("deviceClassName")))
            if device_type is not None:
                out[f"{name}/{sub['name']}"] = device_type
    return out


def validate_claim_spec(spec: object, *, path: str = "spec") -> Problems:
    """Problems of a ResourceClaimSpec (``path`` names it: ``spec``, or ``spec.spec`` in a
    template); ``[]`` when it is fine or holds nothing for our driver."""
    spec_map = _mapping(spec)
    devices = _mapping(spec_map.get("devices")) if spec_map is not None else None
    if devices is None:
        return []
    return misaddressed_configs(devices, path=f"{path}.devices") + validate_config_entries(
        devices.get("config"),
        path=f"{path}.devices.config",
        source=ConfigSource.CLAIM,
        request_device_types=request_device_types(devices.get("requests")),
        request_counts=request_device_counts(devices.get("requests")),
        request_compute=request_compute_percents(devices.get("requests")),
        driver=DRIVER_NAME,
    )


def validate_resource_claim(obj: Mapping[str, Any]) -> Problems:
    """Problems of a v1 ResourceClaim."""
    return validate_claim_spec(obj.get("spec"), path="spec")


def validate_resource_claim_template(obj: Mapping[str, Any]) -> Problems:
    """Problems of a v1 ResourceClaimTemplate (the claim spec is at ``spec.spec``)."""
    spec = _mapping(obj.get("spec"))
    return validate_claim_spec(spec.get("spec") if spec else None, path="spec.spec")


def validate_device_class(obj: Mapping[str, Any]) -> Problems:
    """Problems of a v1 DeviceClass's configs for our driver (class configs)."""
    spec = _mapping(obj.get("spec"))
    if spec is None:
        return []
    return validate_config_entries(
        spec.get("config"), path="spec.config", source=ConfigSource.CLASS, driver=DRIVER_NAME
    )


def validate_node_policy(obj: Mapping[str, Any]) -> Problems:
    """Problems of a GpuNodePolicy (``flexgpu.dev/v1alpha1``)."""
    try:
        parse_node_policy(obj)
    except NodePolicyError as error:
        return list(error.problems)
    return []


def rejection_message(problems: Sequence[str]) -> str:
    """One problem as is; several one per line (``- `` bullets), capped with a count."""
    if len(problems) == 1:
        return problems[0]
    listed = [f"- {problem}" for problem in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        listed.append(f"- ... and {len(problems) - MAX_LISTED_PROBLEMS} more problems")
    return f"{len(problems)} problems:\n" + "\n".join(listed)


def _claim_part(obj: Mapping[str, Any]) -> object:
    return (_mapping(obj.get("spec")) or {}).get("devices")


def _template_part(obj: Mapping[str, Any]) -> object:
    inner = _mapping((_mapping(obj.get("spec")) or {}).get("spec")) or {}
    return inner.get("devices")


def _class_part(obj: Mapping[str, Any]) -> object:
    return (_mapping(obj.get("spec")) or {}).get("config")


def _policy_part(obj: Mapping[str, Any]) -> object:
    return {key: obj.get(key) for key in ("apiVersion", "kind", "spec")}


Validator = Callable[[Mapping[str, Any]], Problems]
Part = Callable[[Mapping[str, Any]], object]


def review(
    validator: Validator,
    part: Part,
    operation: str | None,
    new: Mapping[str, Any] | None,
    old: Mapping[str, Any] | None,
) -> Problems:
    """The problems to reject an admission request with: none for a deletion, for an object
    being deleted, or for an update that leaves the checked ``part`` unchanged."""
    if new is None or operation not in ("CREATE", "UPDATE"):
        return []
    if (_mapping(new.get("metadata")) or {}).get("deletionTimestamp"):
        return []
    if operation == "UPDATE" and old is not None and part(old) == part(new):
        return []
    return validator(new)


# (handler id, group, version, plural, validator, checked part)
ADMISSION_TARGETS: Final[tuple[tuple[str, str, str, str, Validator, Part], ...]] = (
    (
        CLAIMS_HANDLER,
        RESOURCE_GROUP,
        RESOURCE_VERSION,
        "resourceclaims",
        validate_resource_claim,
        _claim_part,
    ),
    (
        TEMPLATES_HANDLER,
        RESOURCE_GROUP,
        RESOURCE_VERSION,
        "resourceclaimtemplates",
        validate_resource_claim_template,
        _template_part,
    ),
    (
        DEVICE_CLASSES_HANDLER,
        RESOURCE_GROUP,
        RESOURCE_VERSION,
        "deviceclasses",
        validate_device_class,
        _class_part,
    ),
    (
        POLICIES_HANDLER,
        CRD_GROUP,
        POLICY_VERSION,
        POLICY_PLURAL,
        validate_node_policy,
        _policy_part,
    ),
)


def answer_admission_review(admission_review: Mapping[str, Any]) -> dict[str, Any] | None:
    """The AdmissionReview response for ``admission_review``, or ``None`` when it is not for
    one of our resources (no subresources). Counts the decision, or the error, per kind."""
    from flexgpu.controller.metrics import WEBHOOK_DECISIONS, WEBHOOK_ERRORS

    request = _mapping(admission_review.get("request")) or {}
    resource = _mapping(request.get("resource")) or {}
    key = (resource.get("group"), resource.get("version"), resource.get("resource"))
    target = next((t for t in ADMISSION_TARGETS if t[1:4] == key), None)
    if target is None or request.get("subResource"):
        return None
    kind, validator, part = target[3], target[4], target[5]
    try:
        problems = review(
            validator,
            part,
            request.get("operation"),
            _mapping(request.get("object")),
            _mapping(request.get("oldObject")),
        )
    except Exception:
        WEBHOOK_ERRORS.labels(kind=kind).inc()
        raise
    WEBHOOK_DECISIONS.labels(kind=kind, allowed=str(not problems).lower()).inc()
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": not problems}
    if problems:
        response["status"] = {"message": rejection_message(problems), "code": REJECTION_CODE}
    return {
        "apiVersion": admission_review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": admission_review.get("kind", "AdmissionReview"),
        "response": response,
    }
