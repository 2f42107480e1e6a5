"""flexgpu.controller.webhook_tls: the Secret's certificates, renewal with an injected clock, and
replicas converging on one Secret."""

from __future__ import annotations

import ssl
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography import x509
from kubernetes.client.exceptions import ApiException

from flexgpu.controller.webhook_tls import (
    RENEW_BEFORE,
    SERVING_VALIDITY,
    CertBundle,
    WebhookTlsError,
    ensure_webhook_secret,
    plan_bundle,
    read_cert_dir,
    service_hostnames,
    write_cert_dir,
)

T0 = datetime(2030, 1, 1, tzinfo=UTC)
HOSTS = service_hostnames("flexgpu-webhook", "flexgpu-system")


def certs(pem: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem)


def leaf(bundle: CertBundle) -> x509.Certificate:
    return certs(bundle.cert)[0]


def test_new_bundle_covers_the_service_names_and_chains_to_the_ca() -> None:
    plan = plan_bundle(None, HOSTS, T0)
    assert plan.reason == "no certificate yet"
    cert = leaf(plan.bundle)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == HOSTS
    assert HOSTS[0] == "flexgpu-webhook.flexgpu-system.svc"
    cert.verify_directly_issued_by(certs(plan.bundle.ca_cert)[0])
    assert cert.not_valid_after_utc == T0 + SERVING_VALIDITY
    assert plan.bundle.ca_bundle == plan.bundle.ca_cert


def test_ip_hosts_become_ip_sans() -> None:
    cert = leaf(plan_bundle(None, ["127.0.0.1"], T0).bundle)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def test_a_valid_bundle_is_reused_until_30_days_before_expiry() -> None:
    bundle = plan_bundle(None, HOSTS, T0).bundle
    expiry = T0 + SERVING_VALIDITY
    for now in (T0, T0 + timedelta(days=100), expiry - RENEW_BEFORE - timedelta(seconds=1)):
        plan = plan_bundle(bundle, HOSTS, now)
        assert not plan.changed and plan.bundle is bundle
    renewed = plan_bundle(bundle, HOSTS, expiry - RENEW_BEFORE + timedelta(seconds=1))
    assert renewed.reason is not None and "serving certificate expires" in renewed.reason
    # Same CA, so every replica still serving the old certificate stays trusted.
    assert renewed.bundle.ca_cert == bundle.ca_cert and renewed.bundle.ca_key == bundle.ca_key
    assert renewed.bundle.ca_bundle.strip() == bundle.ca_cert.strip()
    assert leaf(renewed.bundle).serial_number != leaf(bundle).serial_number


def test_reissued_when_it_does_not_cover_the_wanted_names_or_the_key_does_not_match() -> None:
    bundle = plan_bundle(None, HOSTS, T0).bundle
    plan = plan_bundle(bundle, ["other.flexgpu-system.svc"], T0)
    assert plan.reason is not None and "does not cover" in plan.reason
    other = plan_bundle(None, HOSTS, T0).bundle
    mismatched = CertBundle(bundle.ca_cert, bundle.ca_key, bundle.cert, other.key, bundle.ca_cert)
    assert plan_bundle(mismatched, HOSTS, T0).reason == (
        "the serving key does not match the serving certificate"
    )
    foreign = CertBundle(bundle.ca_cert, bundle.ca_key, other.cert, other.key, bundle.ca_cert)
    assert plan_bundle(foreign, HOSTS, T0).reason == (
        "the serving certificate is not signed by the CA"
    )


def test_garbage_is_replaced_by_a_new_ca() -> None:
    junk = CertBundle(b"x", b"y", b"z", b"w", b"v")
    plan = plan_bundle(junk, HOSTS, T0)
    assert plan.reason == "the CA certificate does not parse"
    assert plan.bundle.ca_bundle.strip() == plan.bundle.ca_cert.strip()


def test_ca_rotation_keeps_the_old_ca_in_the_bundle_until_it_expires() -> None:
    old = plan_bundle(None, HOSTS, T0).bundle
    ca_expiry = certs(old.ca_cert)[0].not_valid_after_utc
    # Serving certificates are never valid beyond their CA.
    late = plan_bundle(old, HOSTS, ca_expiry - timedelta(days=200)).bundle
    assert leaf(late).not_valid_after_utc == ca_expiry
    now = ca_expiry - RENEW_BEFORE + timedelta(hours=1)
    rotated = plan_bundle(late, HOSTS, now)
    assert rotated.reason is not None and "CA certificate expires" in rotated.reason
    new = rotated.bundle
    assert new.ca_cert != old.ca_cert
    assert [c.subject for c in certs(new.ca_bundle)] == [
        certs(new.ca_cert)[0].subject,
        certs(old.ca_cert)[0].subject,
    ]
    leaf(new).verify_directly_issued_by(certs(new.ca_cert)[0])
    assert not plan_bundle(new, HOSTS, now).changed
    # Once the old CA expired, the next renewal drops it.
    after = plan_bundle(new, HOSTS, leaf(new).not_valid_after_utc - timedelta(days=1)).bundle
    assert len(certs(after.ca_bundle)) == 1


def test_secret_data_round_trip() -> None:
    bundle = plan_bundle(None, HOSTS, T0).bundle
    data = bundle.to_secret_data()
    assert set(data) == {"tls.crt", "tls.key", "ca.crt", "ca.key", "ca-bundle.crt"}
    assert CertBundle.from_secret_data(data) == bundle
    assert CertBundle.from_secret_data({"tls.crt": data["tls.crt"]}) is None
    assert CertBundle.from_secret_data({**data, "ca.key": "!!"}) is None
    assert CertBundle.from_secret_data(None) is None


def test_written_files_load_into_an_ssl_context(tmp_path: Path) -> None:
    bundle = plan_bundle(None, ["127.0.0.1"], datetime.now(UTC)).bundle
    files = write_cert_dir(bundle, tmp_path / "certs")
    assert files.certfile == files.keyfile  # one file: certificate and key change together
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        str(files.certfile), str(files.keyfile)
    )
    assert (tmp_path / "certs").stat().st_mode & 0o777 == 0o700
    assert files.certfile.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "certs" / "ca.crt").read_bytes() == bundle.ca_bundle


def test_mounted_cert_dir_is_read_as_is(tmp_path: Path) -> None:
    with pytest.raises(WebhookTlsError, match=r"tls\.crt is missing"):
        read_cert_dir(tmp_path)
    (tmp_path / "tls.crt").write_bytes(b"cert")
    (tmp_path / "tls.key").write_bytes(b"key")
    files = read_cert_dir(tmp_path)
    assert (files.certfile.name, files.keyfile.name, files.ca_bundle) == (
        "tls.crt",
        "tls.key",
        None,
    )
    (tmp_path / "ca.crt").write_bytes(b"ca")
    assert read_cert_dir(tmp_path).ca_bundle == b"ca"


# --------------------------------------------------------------------------- the Secret


class FakeCore:
    """CoreV1Api's Secret calls with the apiserver's optimistic concurrency."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.secret: dict[str, Any] | None = None
        self.version = 0
        self.writes = 0
        self.before_write: Any = None  # called (unlocked) before each write: races

    def read_namespaced_secret(self, name: str, namespace: str) -> Any:
        with self.lock:
            if self.secret is None:
                raise ApiException(status=404)
            meta = SimpleNamespace(resource_version=str(self.version))
            return SimpleNamespace(data=dict(self.secret["data"]), metadata=meta)

    def _store(self, body: dict[str, Any]) -> None:
        self.version += 1
        self.writes += 1
        self.secret = body

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        if self.before_write:
            self.before_write()
        with self.lock:
            if self.secret is not None:
                raise ApiException(status=409)
            assert body["type"] == "kubernetes.io/tls"
            self._store(body)

    def replace_namespaced_secret(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        if self.before_write:
            self.before_write()
        with self.lock:
            if body["metadata"]["resourceVersion"] != str(self.version):
                raise ApiException(status=409)
            self._store(body)


def test_ensure_creates_then_reuses_then_renews() -> None:
    core = FakeCore()
    now = [T0]
    first = ensure_webhook_secret(core, "ns", "tls", HOSTS, clock=lambda: now[0])
    assert core.writes == 1
    assert ensure_webhook_secret(core, "ns", "tls", HOSTS, clock=lambda: now[0]) == first
    assert core.writes == 1
    now[0] = T0 + SERVING_VALIDITY - timedelta(days=29)
    renewed = ensure_webhook_secret(core, "ns", "tls", HOSTS, clock=lambda: now[0])
    assert core.writes == 2 and renewed != first and renewed.ca_cert == first.ca_cert
    assert core.secret is not None
    assert CertBundle.from_secret_data(core.secret["data"]) == renewed


def test_the_loser_of_a_create_race_adopts_the_winners_secret() -> None:
    core = FakeCore()
    winner = plan_bundle(None, HOSTS, T0).bundle

    def someone_else_creates_first() -> None:
        core.before_write = None
        with core.lock:
            core._store({"type": "kubernetes.io/tls", "data": winner.to_secret_data()})

    core.before_write = someone_else_creates_first
    assert ensure_webhook_secret(core, "ns", "tls", HOSTS, clock=lambda: T0) == winner
    assert core.writes == 1


def test_concurrent_replicas_converge_on_one_bundle() -> None:
    core = FakeCore()
    # Every replica has read "no Secret" and planned its own bundle before any writes.
    barrier = threading.Barrier(6)
    waited = threading.local()

    def first_writes_together() -> None:
        if not getattr(waited, "done", False):
            waited.done = True
            barrier.wait(timeout=5)

    core.before_write = first_writes_together
    results: list[CertBundle] = []

    def replica() -> None:
        results.append(ensure_webhook_secret(core, "ns", "tls", HOSTS, clock=lambda: T0))

    threads = [threading.Thread(target=replica) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(results) == 6 and all(result == results[0] for result in results)
    assert core.writes == 1


def test_other_api_errors_surface() -> None:
    class Broken(FakeCore):
        def read_namespaced_secret(self, name: str, namespace: str) -> Any:
            raise ApiException(status=403, reason="Forbidden")

    with pytest.raises(WebhookTlsError, match="cannot read Secret ns/tls"):
        ensure_webhook_secret(Broken(), "ns", "tls", HOSTS, clock=lambda: T0)
