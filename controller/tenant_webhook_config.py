"""The ``MutatingWebhookConfiguration`` that adds the tenant selector (tenant_selector.py)
to claims and claim templates for shared GPUs, built for a controller run outside the chart;
the chart renders the same (tests/unit/test_chart.py compares them).

Two webhooks, claims and claim templates, on CREATE only (a claim's spec and a template's are
immutable). What reaches the webhook is decided by the apiserver first: ``matchConditions``
send only objects with a request for ``shared-gpu.flexgpu.dev``, so other claims never wait on
the controller. ``failurePolicy: Ignore`` with a 3 s timeout, as the validating webhooks: while
the controller is down a shared-GPU claim is created without the selector; the scheduler may
then put it on a GPU that serves another namespace, where prepare refuses it (the pod waits
in ContainerCreating with the reason in its Events until that namespace's claims are gone).
Mixing never follows from an outage; waiting can. No ``namespaceSelector``: the opt-out label
of the validating webhooks (``flexgpu.dev/webhook: disabled``) does not turn tenancy off;
``kubeletPlugin.sharedGpuTenants: any`` does, and then the chart renders no configuration.
``reinvocationPolicy: IfNeeded``: when a later mutating webhook adds a request, the selector
is added to it too (the patch is idempotent).
"""

from __future__ import annotations

from typing import Any, Final

from flexgpu.controller.tenant_selector import TENANT_CLAIMS_HANDLER, TENANT_TEMPLATES_HANDLER
from flexgpu.controller.webhook_config import (
    CLAIM_TIMEOUT_S,
    ClientTarget,
    FailurePolicy,
    client_config,
)
from flexgpu.driver.names import DRIVER_NAME, SHARED_GPU_DEVICE_CLASS

TENANT_CONFIGURATION_NAME: Final = "flexgpu-tenancy"


def shared_request_condition(spec: str) -> str:
    """CEL over the v1 object: the claim spec at ``spec`` has a request or subrequest for a
    shared GPU. Every optional field is guarded with ``has``, so it cannot error."""
    cls = f"'{SHARED_GPU_DEVICE_CLASS}'"
    return (
        f"has({spec}.devices) && has({spec}.devices.requests) && "
        f"{spec}.devices.requests.exists(r, "
        f"(has(r.exactly) && has(r.exactly.deviceClassName) && "
        f"r.exactly.deviceClassName == {cls}) || "
        f"(has(r.firstAvailable) && r.firstAvailable.exists(s, "
        f"has(s.deviceClassName) && s.deviceClassName == {cls})))"
    )


def build_tenant_webhook_configuration(
    target: ClientTarget,
    ca_bundle: bytes | None,
    *,
    name: str = TENANT_CONFIGURATION_NAME,
    object_selector: dict[str, Any] | None = None,
    failure_policy: FailurePolicy = "Ignore",
    timeout_s: int = CLAIM_TIMEOUT_S,
) -> dict[str, Any]:
    """The MutatingWebhookConfiguration as a JSON-ready dict (see the module docstring)."""
    hooks = (
        ("resourceclaims", TENANT_CLAIMS_HANDLER, "object.spec"),
        ("resourceclaimtemplates", TENANT_TEMPLATES_HANDLER, "object.spec.spec"),
    )
    webhooks = []
    for plural, handler, spec in hooks:
        webhook: dict[str, Any] = {
            "name": f"tenancy.{plural}.{DRIVER_NAME}",
            "clientConfig": client_config(target, handler, ca_bundle),
            "rules": [
                {
                    "operations": ["CREATE"],
                    "apiGroups": ["resource.k8s.io"],
                    "apiVersions": ["v1"],
                    "resources": [plural],
                    "scope": "Namespaced",
                }
            ],
            "failurePolicy": failure_policy,
            "matchPolicy": "Equivalent",
            "sideEffects": "None",
            "timeoutSeconds": timeout_s,
            "admissionReviewVersions": ["v1"],
            "reinvocationPolicy": "IfNeeded",
            "matchConditions": [
                {"name": "shared-gpu-request", "expression": shared_request_condition(spec)}
            ],
        }
        if object_selector is not None:
            webhook["objectSelector"] = object_selector
        webhooks.append(webhook)
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/name": "flexgpu",
                "app.kubernetes.io/component": "webhook",
            },
        },
        "webhooks": webhooks,
    }
