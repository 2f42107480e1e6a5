"""The webhook's HTTP endpoint, served for real (plain HTTP on a free loopback port), against
requests the apiserver would never send: each is answered with a 4xx and a one-line reason,
never a traceback and never ``allowed: true``; unknown paths get 404."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from flexgpu.controller.admission_review import SERVED
from flexgpu.controller.webhook_server import (
    AdmissionHttpsServer,
    FlexgpuWebhookServer,
    WebhookOptions,
)
from flexgpu.controller.webhook_tls import plan_bundle

CLAIMS = {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"}


def review(**request: Any) -> dict[str, Any]:
    body = {
        "uid": "u-1",
        "operation": "CREATE",
        "userInfo": {"username": "alice"},
        "resource": CLAIMS,
        "object": {"metadata": {"name": "c"}, "spec": {}},
        **request,
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": body}


def broken(request: Any) -> Any:
    raise KeyError("a bug")


async def kopf_engine(request: Any, **_: Any) -> Any:
    """What kopf hands its server: never called, reviews are answered without it."""
    raise AssertionError("kopf's admission engine was called")


@pytest.fixture
async def url() -> AsyncIterator[str]:
    server = AdmissionHttpsServer(addr="127.0.0.1", port=0, host="127.0.0.1")
    async for client_config in server():
        yield str(client_config["url"]).rstrip("/")
        break


async def post(url: str, path: str, data: bytes) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r,
    ):
        return r.status, await r.text()


def dumps(value: object) -> bytes:
    return json.dumps(value).encode()


MALFORMED: list[tuple[str, str, bytes, int, str]] = [
    ("not JSON", "/resourceclaims", b"{not json", 400, "the body is not JSON"),
    ("not UTF-8", "/resourceclaims", b'{"a": "\xff"}', 400, "the body is not UTF-8"),
    ("deeply nested", "/resourceclaims", b"[" * 100_000 + b"]" * 100_000, 400, "the body is"),
    ("a JSON list", "/resourceclaims", b"[1, 2]", 400, "the body is [1, 2]; allowed: a JSON"),
    ("wrong kind", "/resourceclaims", dumps({**review(), "kind": "Pod"}), 400, "kind: 'Pod'"),
    (
        "no request",
        "/resourceclaims",
        dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
        400,
        "request: null is not allowed; allowed: an object",
    ),
    (
        "request not an object",
        "/resourceclaims",
        dumps({**review(), "request": 7}),
        400,
        "request: 7",
    ),
    ("no uid", "/resourceclaims", dumps(review(uid="")), 400, "request.uid: '' is not allowed"),
    ("bad operation", "/resourceclaims", dumps(review(operation="EAT")), 400, "request.operation"),
    ("no userInfo", "/resourceclaims", dumps(review(userInfo=None)), 400, "request.userInfo"),
    ("object a string", "/resourceclaims", dumps(review(object="x")), 400, "request.object: 'x'"),
    (
        "no object at all",
        "/resourceclaims",
        dumps(review(object=None)),
        400,
        "request.object: missing",
    ),
    (
        "another resource at this path",
        "/resourceclaims",
        dumps(review(resource={"group": "", "version": "v1", "resource": "pods"})),
        400,
        'request.resource: {"group": "", "version": "v1", "resource": "pods"} is not allowed at '
        "/resourceclaims",
    ),
    (
        "unknown path",
        "/mutate-everything",
        dumps(review()),
        404,
        "no webhook at 'mutate-everything'",
    ),
    ("empty path", "/", dumps(review()), 404, "no webhook at ''"),
    ("huge body", "/resourceclaims", b'{"a": "' + b"x" * (2 << 20) + b'"}', 413, ""),
]


@pytest.mark.parametrize(
    ("path", "data", "status", "reason"),
    [row[1:] for row in MALFORMED],
    ids=[row[0] for row in MALFORMED],
)
async def test_malformed_requests_get_a_4xx_and_a_short_reason(
    url: str, path: str, data: bytes, status: int, reason: str
) -> None:
    got, text = await post(url, path, data)
    assert got == status, text
    assert reason in text
    assert "Traceback" not in text and 'allowed": true' not in text
    assert len(text) < 400


async def test_echoed_input_is_shortened_with_its_length(url: str) -> None:
    status, text = await post(url, "/" + "p" * 5000, dumps(review()))
    assert status == 404
    assert "... (5002 characters)" in text and len(text) < 400


async def test_a_well_formed_review_is_answered(url: str) -> None:
    status, text = await post(url, "/resourceclaims", dumps(review()))
    assert status == 200
    answer = json.loads(text)
    assert answer["response"] == {"uid": "u-1", "allowed": True}


async def test_a_failing_handler_is_a_500_without_a_traceback() -> None:
    server = AdmissionHttpsServer(addr="127.0.0.1", port=0, host="127.0.0.1", answer=broken)
    async for client_config in server():
        status, text = await post(
            str(client_config["url"]).rstrip("/"), "/resourceclaims", dumps(review())
        )
        break
    assert status == 500
    assert text.strip() == "internal error in the admission webhook"


async def test_port_zero_publishes_the_port_actually_listened_on(tmp_path: Path) -> None:
    """``--webhook-listen=HOST:0`` (as the demo runs it): the configuration must name the port
    the server bound, not port 0, or the apiserver can never reach the webhook."""
    bundle = plan_bundle(None, ["127.0.0.1"], datetime.now(UTC)).bundle
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "tls.crt").write_bytes(bundle.cert)
    (certs / "tls.key").write_bytes(bundle.key)
    (certs / "ca.crt").write_bytes(bundle.ca_bundle)
    options = WebhookOptions(
        listen_addr="127.0.0.1",
        port=0,
        cert_dir=certs,
        tenant_configuration_name="tenancy",
        toleration_configuration_name="tolerations",
    )
    server = FlexgpuWebhookServer(options, ApiClient())
    created: list[dict[str, Any]] = []

    def absent(name: str) -> None:
        raise ApiException(status=404)

    server._admission = SimpleNamespace(
        read_validating_webhook_configuration=absent,
        create_validating_webhook_configuration=created.append,
        read_mutating_webhook_configuration=absent,
        create_mutating_webhook_configuration=created.append,
    )
    async for _config in server(kopf_engine):
        break
    assert [c["kind"] for c in created] == [
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ]
    urls = {hook["clientConfig"]["url"] for c in created for hook in c["webhooks"]}
    port = server.bound_port
    assert port and port > 0
    assert urls == {f"https://127.0.0.1:{port}/{h}" for h in SERVED}
    context = ssl.create_default_context(cadata=bundle.ca_bundle.decode())
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"https://127.0.0.1:{port}/resourceclaims", data=dumps(review()), ssl=context
        ) as r,
    ):
        assert r.status == 200


async def test_renewed_certificate_files_are_served_without_a_restart(tmp_path: Path) -> None:
    """cert-manager replaces the mounted files: the server yields again (so the configuration's
    CA bundle is re-applied) and new connections get the new certificate."""
    now = datetime.now(UTC)
    first = plan_bundle(None, ["127.0.0.1"], now).bundle
    certfile, keyfile = tmp_path / "tls.crt", tmp_path / "tls.key"
    certfile.write_bytes(first.cert)
    keyfile.write_bytes(first.key)
    server = AdmissionHttpsServer(
        addr="127.0.0.1",
        port=0,
        host="127.0.0.1",
        certfile=certfile,
        keyfile=keyfile,
        file_check_interval_s=0.05,
    )
    configs = server()
    url = str((await anext(configs))["url"]).rstrip("/")

    async def status_with(ca: bytes) -> int:
        context = ssl.create_default_context(cadata=ca.decode())
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/resourceclaims", data=dumps(review()), ssl=context) as r,
        ):
            return r.status

    try:
        assert await status_with(first.ca_bundle) == 200
        second = plan_bundle(None, ["127.0.0.1"], now).bundle  # a new CA, as a fresh issue
        assert second.ca_bundle != first.ca_bundle
        keyfile.write_bytes(second.key)
        certfile.write_bytes(second.cert)
        await asyncio.wait_for(anext(configs), timeout=10)
        assert await status_with(second.ca_bundle) == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await status_with(first.ca_bundle)
    finally:
        await configs.aclose()
