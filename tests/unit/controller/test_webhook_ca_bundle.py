"""With the chart owning the webhook configuration, the controller only fills in each
webhook's caBundle: it never creates a configuration that is not there (an uninstall or
webhook.enabled=false must not be undone), changes nothing else, and a concurrent writer makes
it read again instead of being overwritten."""

from __future__ import annotations

import base64
from typing import Any

from kubernetes import client

from flexgpu.controller.webhook_config import patch_ca_bundle


class FakeAdmission:
    def __init__(self, hooks: int | None, conflicts: int = 0) -> None:
        self.version = 1
        self.hooks: list[dict[str, Any]] | None = (
            None
            if hooks is None
            else [
                {"name": f"h{i}", "clientConfig": {"service": {"name": "svc"}}}
                for i in range(hooks)
            ]
        )
        self.conflicts = conflicts
        self.patches: list[list[dict[str, Any]]] = []
        self.created = 0

    def read_validating_webhook_configuration(self, name: str) -> Any:
        if self.hooks is None:
            raise client.ApiException(status=404, reason="NotFound")
        return client.V1ValidatingWebhookConfiguration(
            metadata=client.V1ObjectMeta(name=name, resource_version=str(self.version)),
            webhooks=[
                client.V1ValidatingWebhook(
                    name=h["name"],
                    admission_review_versions=["v1"],
                    side_effects="None",
                    client_config=client.AdmissionregistrationV1WebhookClientConfig(
                        ca_bundle=h["clientConfig"].get("caBundle")
                    ),
                )
                for h in self.hooks
            ],
        )

    def create_validating_webhook_configuration(self, body: Any) -> None:
        self.created += 1

    def patch_validating_webhook_configuration(self, name: str, ops: list[dict[str, Any]]) -> None:
        self.patches.append(ops)
        if self.conflicts:  # someone wrote in between: the test op fails
            self.conflicts -= 1
            self.version += 1
            raise client.ApiException(status=422, reason="Invalid")
        assert self.hooks is not None
        assert ops[0] == {
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": str(self.version),
        }
        for op in ops[1:]:
            index = int(op["path"].split("/")[2])
            self.hooks[index]["clientConfig"]["caBundle"] = op["value"]
        self.version += 1


def test_fills_in_every_caBundle_and_nothing_else() -> None:
    admission = FakeAdmission(hooks=4)
    patch_ca_bundle(admission, "cfg", b"PEM")
    assert admission.hooks is not None
    encoded = base64.b64encode(b"PEM").decode()
    assert [h["clientConfig"] for h in admission.hooks] == [
        {"service": {"name": "svc"}, "caBundle": encoded}
    ] * 4
    (ops,) = admission.patches
    assert {op["path"] for op in ops[1:]} == {
        f"/webhooks/{i}/clientConfig/caBundle" for i in range(4)
    }
    # Already right: no write at all.
    patch_ca_bundle(admission, "cfg", b"PEM")
    assert len(admission.patches) == 1


def test_a_missing_configuration_is_not_created() -> None:
    admission = FakeAdmission(hooks=None)
    patch_ca_bundle(admission, "cfg", b"PEM")
    assert admission.created == 0 and admission.patches == []


def test_a_concurrent_write_is_read_again() -> None:
    admission = FakeAdmission(hooks=2, conflicts=2)
    patch_ca_bundle(admission, "cfg", b"PEM")
    assert len(admission.patches) == 3
    assert admission.hooks is not None
    assert all(h["clientConfig"]["caBundle"] for h in admission.hooks)


class FakeMutatingOnly(FakeAdmission):
    """Serves the configuration only through the mutating calls: a validating call fails."""

    def read_mutating_webhook_configuration(self, name: str) -> Any:
        return super().read_validating_webhook_configuration(name)

    def patch_mutating_webhook_configuration(self, name: str, ops: list[dict[str, Any]]) -> None:
        super().patch_validating_webhook_configuration(name, ops)

    def read_validating_webhook_configuration(self, name: str) -> Any:
        raise AssertionError("the tenancy configuration is a mutating one")


def test_the_tenancy_configuration_is_patched_through_the_mutating_api() -> None:
    admission = FakeMutatingOnly(hooks=2)
    patch_ca_bundle(admission, "flexgpu-tenancy", b"PEM", "mutating")
    assert admission.hooks is not None
    assert all(h["clientConfig"]["caBundle"] for h in admission.hooks)
    assert len(admission.patches) == 1
