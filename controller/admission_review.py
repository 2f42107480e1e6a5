"""Is an HTTP request to the webhook a well-formed AdmissionReview for the path it came to?

The apiserver always sends one; anything else (a probe, a scanner, a mistaken client, a broken
proxy) is refused with a 4xx and a one-line reason before any handler runs, so a malformed body
can neither raise inside kopf (a 500 with a traceback) nor be allowed by default (a path no
handler serves). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from flexgpu.controller.admission import ADMISSION_TARGETS
from flexgpu.controller.gpu_tolerations import GPU_TOLERATIONS_HANDLER
from flexgpu.controller.tenant_selector import TENANT_HANDLERS
from flexgpu.driver.user_text import shorten

REVIEW_API_VERSION: Final = "admission.k8s.io/v1"
REVIEW_KIND: Final = "AdmissionReview"
OPERATIONS: Final = ("CREATE", "UPDATE", "DELETE", "CONNECT")
# handler id (the URL's last segment) -> (group, version, plural) it validates or, for the
# tenancy and toleration handlers, mutates.
SERVED: Final[dict[str, tuple[str, str, str]]] = {
    target[0]: (target[1], target[2], target[3]) for target in ADMISSION_TARGETS
} | {handler: target[:3] for handler, target in TENANT_HANDLERS.items()}
SERVED[GPU_TOLERATIONS_HANDLER] = ("", "v1", "pods")


@dataclass(frozen=True)
class Refusal:
    """An HTTP status and the reason, one line, with any echoed input shortened."""

    status: int
    reason: str


def unknown_path(path: str) -> Refusal:
    allowed = ", ".join(f"/{handler}" for handler in SERVED)
    return Refusal(404, f"no webhook at {shorten(repr(path))}; allowed: {allowed}")


def parse_review(raw: bytes, handler_id: str) -> tuple[dict[str, Any] | None, Refusal | None]:
    """The decoded AdmissionReview, or why it is refused (never raises)."""
    if handler_id not in SERVED:
        return None, unknown_path(handler_id)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, Refusal(400, "the body is not UTF-8 text; allowed: a JSON AdmissionReview")
    except (ValueError, RecursionError) as error:
        reason = shorten(str(error))
        return None, Refusal(
            400, f"the body is not JSON ({reason}); allowed: a JSON AdmissionReview"
        )
    problem = review_problem(body, handler_id)
    if problem:
        return None, Refusal(400, problem)
    return body, None


def _show(value: object) -> str:
    return shorten(json.dumps(value) if not isinstance(value, str) else repr(value))


def review_problem(body: object, handler_id: str) -> str:
    """Why ``body`` is not an AdmissionReview request for the handler ``handler_id`` serves,
    naming the field, the value and what is allowed; ``""`` when it is one."""
    if not isinstance(body, Mapping):
        return f"the body is {_show(body)}; allowed: a JSON object (an AdmissionReview)"
    for key, wanted in (("apiVersion", REVIEW_API_VERSION), ("kind", REVIEW_KIND)):
        if body.get(key) != wanted:
            return f"{key}: {_show(body.get(key))} is not allowed; allowed: {wanted}"
    request = body.get("request")
    if not isinstance(request, Mapping):
        return f"request: {_show(request)} is not allowed; allowed: an object"
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        return f"request.uid: {_show(uid)} is not allowed; allowed: a non-empty string"
    operation = request.get("operation")
    if operation not in OPERATIONS:
        allowed = ", ".join(OPERATIONS)
        return f"request.operation: {_show(operation)} is not allowed; allowed: {allowed}"
    if not isinstance(request.get("userInfo"), Mapping):
        return (
            f"request.userInfo: {_show(request.get('userInfo'))} is not allowed; allowed: an object"
        )
    for key in ("object", "oldObject"):
        value = request.get(key)
        if value is not None and not isinstance(value, Mapping):
            return f"request.{key}: {_show(value)} is not allowed; allowed: an object or null"
    if request.get("object") is None and request.get("oldObject") is None:
        return "request.object: missing, and so is request.oldObject; allowed: an object"
    group, version, plural = SERVED[handler_id]
    resource = request.get("resource")
    shown = (
        (resource.get("group"), resource.get("version"), resource.get("resource"))
        if isinstance(resource, Mapping)
        else None
    )
    if shown != (group, version, plural):
        wanted = f'{{"group": "{group}", "version": "{version}", "resource": "{plural}"}}'
        return (
            f"request.resource: {_show(resource)} is not allowed at /{handler_id}; "
            f"allowed: {wanted}"
        )
    subresource = request.get("subResource")
    if subresource:
        return f"request.subResource: {_show(subresource)} is not allowed; allowed: none"
    return ""
