"""flexgpu.controller.webhook_config: the ValidatingWebhookConfiguration, its CEL matchConditions
(evaluated with cel-python against v1 shapes) and create-or-replace."""

from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import Any

import celpy
import pytest
from kubernetes.client.exceptions import ApiException

from flexgpu.controller.webhook_config import (
    CHANGED_CONDITION,
    CLAIM_CONDITION,
    DEVICE_CLASS_CONDITION,
    TEMPLATE_CONDITION,
    ServiceRef,
    apply_webhook_configuration,
    build_webhook_configuration,
)
from flexgpu.controller.webhook_server import WebhookOptions

CA = b"-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n"


def test_webhooks_policies_timeouts_and_urls() -> None:
    body = build_webhook_configuration("https://127.0.0.1:9443/", CA)
    assert body["metadata"]["name"] == "flexgpu-validation"
    hooks = {hook["name"]: hook for hook in body["webhooks"]}
    assert list(hooks) == [
        "resourceclaims.gpu.flexgpu.dev",
        "resourceclaimtemplates.gpu.flexgpu.dev",
        "deviceclasses.gpu.flexgpu.dev",
        "gpunodepolicies.flexgpu.dev",
    ]
    assert [(h["failurePolicy"], h["timeoutSeconds"]) for h in hooks.values()] == [
        ("Ignore", 3),
        ("Ignore", 3),
        ("Ignore", 3),
        ("Fail", 10),
    ]
    assert [h["clientConfig"]["url"] for h in hooks.values()] == [
        "https://127.0.0.1:9443/resourceclaims",
        "https://127.0.0.1:9443/resourceclaimtemplates",
        "https://127.0.0.1:9443/deviceclasses",
        "https://127.0.0.1:9443/gpunodepolicies",
    ]
    for hook in hooks.values():
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == CA
        assert hook["sideEffects"] == "None" and hook["matchPolicy"] == "Equivalent"
        assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    policy = hooks["gpunodepolicies.flexgpu.dev"]
    assert policy["rules"][0] == {
        "operations": ["CREATE", "UPDATE"],
        "apiGroups": ["flexgpu.dev"],
        "apiVersions": ["v1alpha1"],
        "resources": ["gpunodepolicies"],
        "scope": "Cluster",
    }
    assert [c["name"] for c in policy["matchConditions"]] == ["changed"]
    claims = hooks["resourceclaims.gpu.flexgpu.dev"]
    assert [c["name"] for c in claims["matchConditions"]] == ["flexgpu-config", "changed"]
    assert claims["namespaceSelector"]["matchExpressions"][0]["key"] == "flexgpu.dev/webhook"
    assert "namespaceSelector" not in hooks["deviceclasses.gpu.flexgpu.dev"]


def test_service_reference_and_no_ca_bundle() -> None:
    body = build_webhook_configuration(ServiceRef("flexgpu-system", "flexgpu-webhook"), None)
    config = body["webhooks"][0]["clientConfig"]
    assert config == {
        "service": {
            "namespace": "flexgpu-system",
            "name": "flexgpu-webhook",
            "port": 443,
            "path": "/resourceclaims",
        }
    }
    with pytest.raises(ValueError, match="https://"):
        build_webhook_configuration("http://127.0.0.1:1", None)


def test_options_targets() -> None:
    local = WebhookOptions(listen_addr="127.0.0.1", port=18443)
    assert (local.target, local.hostnames) == ("https://127.0.0.1:18443", ["127.0.0.1"])
    anywhere = WebhookOptions(listen_addr="0.0.0.0", port=9443, url_host="::1")
    assert anywhere.target == "https://[::1]:9443"
    cluster = WebhookOptions(service=ServiceRef("ns", "svc"))
    assert cluster.target == ServiceRef("ns", "svc")
    assert cluster.hostnames[0] == "svc.ns.svc"


# --------------------------------------------------------------------------- CEL

_ENV = celpy.Environment()


def cel(expression: str, obj: Any, old: Any = None, operation: str = "CREATE") -> bool:
    program = _ENV.program(_ENV.compile(expression))
    result = program.evaluate(
        {
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel({"operation": operation}),
        }
    )
    assert not isinstance(result, celpy.CELEvalError), result
    return bool(result)


def devices(*drivers: str | None) -> dict[str, Any]:
    config: list[dict[str, Any]] = []
    for driver in drivers:
        config.append({"opaque": {"driver": driver, "parameters": {}}} if driver else {})
    return {"requests": [{"name": "r"}], "config": config}


@pytest.mark.parametrize(
    ("spec_devices", "sent"),
    [
        (devices("gpu.flexgpu.dev"), True),
        (devices("gpu.nvidia.com", "gpu.flexgpu.dev"), True),
        (devices("gpu.nvidia.com"), False),
        (devices(None), False),  # a config without opaque (a newer config type)
        (devices(), False),
        ({"requests": [{"name": "r"}]}, False),
        (None, False),
    ],
)
def test_claim_and_template_conditions(spec_devices: Any, sent: bool) -> None:
    spec = {} if spec_devices is None else {"devices": spec_devices}
    assert cel(CLAIM_CONDITION, {"metadata": {}, "spec": spec}) is sent
    assert cel(TEMPLATE_CONDITION, {"metadata": {}, "spec": {"spec": spec}}) is sent
    assert cel(TEMPLATE_CONDITION, {"metadata": {}, "spec": {}}) is False


@pytest.mark.parametrize(
    ("requests", "sent"),
    [
        ([{"name": "r", "exactly": {"deviceClassName": "shared-gpu.flexgpu.dev"}}], True),
        (
            [
                {
                    "name": "r",
                    "firstAvailable": [{"name": "s", "deviceClassName": "mig.flexgpu.dev"}],
                }
            ],
            True,
        ),
        ([{"name": "r", "exactly": {"deviceClassName": "gpu.nvidia.com"}}], False),
        ([{"name": "r"}], False),
    ],
)
def test_nvidia_configs_beside_our_requests_are_sent(requests: Any, sent: bool) -> None:
    """NVIDIA's driver name on a claim that asks for our classes reaches the webhook (which
    refuses it: no driver reads it); NVIDIA's own claims never do."""
    spec = {"devices": {"requests": requests, "config": devices("gpu.nvidia.com")["config"]}}
    assert cel(CLAIM_CONDITION, {"metadata": {}, "spec": spec}) is sent
    assert cel(TEMPLATE_CONDITION, {"metadata": {}, "spec": {"spec": spec}}) is sent


def test_device_class_condition() -> None:
    ours = {"spec": {"config": [{"opaque": {"driver": "gpu.flexgpu.dev", "parameters": {}}}]}}
    theirs = {"spec": {"config": [{"opaque": {"driver": "x.example.com", "parameters": {}}}]}}
    assert cel(DEVICE_CLASS_CONDITION, ours) is True
    assert cel(DEVICE_CLASS_CONDITION, theirs) is False
    assert cel(DEVICE_CLASS_CONDITION, {"spec": {"selectors": []}}) is False


def test_changed_condition() -> None:
    obj = {"metadata": {"name": "a"}, "spec": {"x": 1}}
    relabelled = {"metadata": {"name": "a", "labels": {"l": "v"}}, "spec": {"x": 1}}
    edited = {"metadata": {"name": "a"}, "spec": {"x": 2}}
    deleting = {"metadata": {"name": "a", "deletionTimestamp": "t"}, "spec": {"x": 2}}
    assert cel(CHANGED_CONDITION, obj, None, "CREATE") is True
    assert cel(CHANGED_CONDITION, relabelled, obj, "UPDATE") is False
    assert cel(CHANGED_CONDITION, edited, obj, "UPDATE") is True
    assert cel(CHANGED_CONDITION, deleting, obj, "UPDATE") is False


# --------------------------------------------------------------------------- apply


class FakeAdmission:
    def __init__(self, existing: Any = None, conflicts: int = 0) -> None:
        self.existing = existing
        self.conflicts = conflicts
        self.created: list[Any] = []
        self.replaced: list[Any] = []

    def read_validating_webhook_configuration(self, name: str) -> Any:
        if self.existing is None:
            raise ApiException(status=404)
        return self.existing

    def create_validating_webhook_configuration(self, body: Any) -> None:
        self.created.append(body)

    def replace_validating_webhook_configuration(self, name: str, body: Any) -> None:
        if self.conflicts:
            self.conflicts -= 1
            raise ApiException(status=409)
        self.replaced.append(body)


def _existing(ca_bundle: str | None) -> Any:
    hooks = [
        SimpleNamespace(name=name, client_config=SimpleNamespace(ca_bundle=ca_bundle))
        for name in ("resourceclaims.gpu.flexgpu.dev", "gpunodepolicies.flexgpu.dev")
    ]
    return SimpleNamespace(webhooks=hooks, metadata=SimpleNamespace(resource_version="7"))


def test_apply_creates_when_missing() -> None:
    fake = FakeAdmission()
    body = build_webhook_configuration("https://127.0.0.1:1", CA)
    apply_webhook_configuration(fake, body)
    assert fake.created == [body] and fake.replaced == []


def test_apply_replaces_on_the_read_version_and_retries_conflicts() -> None:
    fake = FakeAdmission(_existing("b2xk"), conflicts=2)
    body = build_webhook_configuration("https://127.0.0.1:1", CA)
    apply_webhook_configuration(fake, body)
    (replaced,) = fake.replaced
    assert replaced["metadata"]["resourceVersion"] == "7"
    assert replaced["webhooks"] == body["webhooks"]
    assert "resourceVersion" not in body["metadata"]  # the caller's dict is left alone


def test_apply_without_ca_keeps_the_injected_bundle() -> None:
    fake = FakeAdmission(_existing("aW5qZWN0ZWQ="))
    apply_webhook_configuration(fake, build_webhook_configuration("https://127.0.0.1:1", None))
    hooks = {hook["name"]: hook for hook in fake.replaced[0]["webhooks"]}
    assert hooks["resourceclaims.gpu.flexgpu.dev"]["clientConfig"]["caBundle"] == "aW5qZWN0ZWQ="
    assert "caBundle" not in hooks["deviceclasses.gpu.flexgpu.dev"]["clientConfig"]
