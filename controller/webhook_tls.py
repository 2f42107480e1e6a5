"""TLS for the admission webhook with no manual steps.

Two modes:

* **Secret mode** (default): the controller keeps a self-generated CA and a serving certificate
  in a Secret (``kubernetes.io/tls``; keys ``tls.crt``, ``tls.key``, ``ca.crt``, ``ca.key`` and
  ``ca-bundle.crt``). ``ensure_webhook_secret`` creates it if missing, reuses it while valid,
  reissues the serving certificate (same CA) when it expires within ``RENEW_BEFORE`` or does
  not cover the wanted host names, and replaces the CA itself when *it* expires within
  ``RENEW_BEFORE``, keeping the old CA in ``ca-bundle.crt`` until it expires so that replicas
  still serving the old certificate stay trusted. Replicas converge on one Secret: a create
  that loses the race (409) or an update on a stale ``resourceVersion`` (409) re-reads the
  Secret and takes what the winner wrote if it is valid.
* **Mounted mode** (``--webhook-cert-dir``, e.g. cert-manager): ``tls.crt``/``tls.key`` (and
  ``ca.crt`` when present) are read from the folder as they are; the Secret is not touched.

The decision (``plan_bundle``) is pure and takes the time as an argument; only
``ensure_webhook_secret`` talks to the API server.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

logger = logging.getLogger(__name__)

CA_VALIDITY: Final = timedelta(days=3650)
SERVING_VALIDITY: Final = timedelta(days=365)
RENEW_BEFORE: Final = timedelta(days=30)
# Backdating absorbs clock skew between the replica that issued and the apiserver.
_BACKDATE: Final = timedelta(minutes=5)
_CONFLICT_RETRIES: Final = 8

TLS_CERT_KEY: Final = "tls.crt"
TLS_KEY_KEY: Final = "tls.key"
CA_CERT_KEY: Final = "ca.crt"
CA_KEY_KEY: Final = "ca.key"
CA_BUNDLE_KEY: Final = "ca-bundle.crt"
SERVER_PEM: Final = "server.pem"

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


class WebhookTlsError(RuntimeError):
    """The webhook's certificates cannot be read or stored."""


@dataclass(frozen=True)
class CertBundle:
    """PEM texts: the CA, its key, the serving certificate and key, and the CA bundle to give
    the apiserver (the current CA first, then older CAs not yet expired)."""

    ca_cert: bytes
    ca_key: bytes
    cert: bytes
    key: bytes
    ca_bundle: bytes

    def to_secret_data(self) -> dict[str, str]:
        items = {
            TLS_CERT_KEY: self.cert,
            TLS_KEY_KEY: self.key,
            CA_CERT_KEY: self.ca_cert,
            CA_KEY_KEY: self.ca_key,
            CA_BUNDLE_KEY: self.ca_bundle,
        }
        return {key: base64.b64encode(value).decode("ascii") for key, value in items.items()}

    @classmethod
    def from_secret_data(cls, data: dict[str, str] | None) -> CertBundle | None:
        """The bundle in a Secret's ``data``; ``None`` if a key is missing or not base64."""
        data = data or {}
        try:
            raw = {key: base64.b64decode(value, validate=True) for key, value in data.items()}
            return cls(
                ca_cert=raw[CA_CERT_KEY],
                ca_key=raw[CA_KEY_KEY],
                cert=raw[TLS_CERT_KEY],
                key=raw[TLS_KEY_KEY],
                ca_bundle=raw.get(CA_BUNDLE_KEY) or raw[CA_CERT_KEY],
            )
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True)
class Plan:
    """What ``plan_bundle`` decided: the bundle to use and, if it is new, why."""

    bundle: CertBundle
    reason: str | None  # None: the existing bundle is reused as is

    @property
    def changed(self) -> bool:
        return self.reason is not None


# --------------------------------------------------------------------------- generation


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def generate_ca(now: datetime, validity: timedelta = CA_VALIDITY) -> tuple[bytes, bytes]:
    """A new self-signed CA: ``(cert PEM, key PEM)``."""
    key = _new_key()
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"flexgpu-webhook-ca-{int(now.timestamp())}")]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def _san(hostname: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(hostname))
    except ValueError:
        return x509.DNSName(hostname)


def issue_serving_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    hostnames: Sequence[str],
    now: datetime,
    validity: timedelta = SERVING_VALIDITY,
) -> tuple[bytes, bytes]:
    """A serving certificate for ``hostnames`` (DNS names or IPs) signed by the CA, valid for
    ``validity`` but never beyond the CA: ``(cert PEM, key PEM)``."""
    if not hostnames:
        raise ValueError("a serving certificate needs at least one host name")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise WebhookTlsError("the CA key is not an EC key")
    key = _new_key()
    not_after = min(now + validity, ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([_san(name) for name in dict.fromkeys(hostnames)]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def new_bundle(hostnames: Sequence[str], now: datetime) -> CertBundle:
    ca_cert, ca_key = generate_ca(now)
    cert, key = issue_serving_cert(ca_cert, ca_key, hostnames, now)
    return CertBundle(ca_cert, ca_key, cert, key, ca_cert)


# --------------------------------------------------------------------------- checks


def _load_certs(pem: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


def _same_public_key(cert: x509.Certificate, key_pem: bytes) -> bool:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return False
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    return bool(
        cert.public_key().public_bytes(encoding, public)
        == key.public_key().public_bytes(encoding, public)
    )


def _covers(cert: x509.Certificate, hostnames: Sequence[str]) -> bool:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    dns = set(sans.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    for name in hostnames:
        try:
            if str(ipaddress.ip_address(name)) not in ips:
                return False
        except ValueError:
            if name not in dns:
                return False
    return True


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def ca_problem(
    bundle: CertBundle, now: datetime, renew_before: timedelta = RENEW_BEFORE
) -> str | None:
    """Why the CA must be replaced, or ``None`` if it can stay."""
    cas = _load_certs(bundle.ca_cert)
    if len(cas) != 1:
        return "the CA certificate does not parse"
    ca = cas[0]
    if not _same_public_key(ca, bundle.ca_key):
        return "the CA key does not match the CA certificate"
    if now < ca.not_valid_before_utc:
        return "the CA certificate is not valid yet"
    if ca.not_valid_after_utc - now <= renew_before:
        return f"the CA certificate expires at {ca.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
    return None


def serving_problem(
    bundle: CertBundle,
    hostnames: Sequence[str],
    now: datetime,
    renew_before: timedelta = RENEW_BEFORE,
) -> str | None:
    """Why the serving certificate must be reissued (the CA being fine), or ``None``."""
    certs = _load_certs(bundle.cert)
    if len(certs) != 1:
        return "the serving certificate does not parse"
    cert = certs[0]
    if not _same_public_key(cert, bundle.key):
        return "the serving key does not match the serving certificate"
    if not _signed_by(cert, _load_certs(bundle.ca_cert)[0]):
        return "the serving certificate is not signed by the CA"
    if not _covers(cert, hostnames):
        return f"the serving certificate does not cover {', '.join(hostnames)}"
    if now < cert.not_valid_before_utc:
        return "the serving certificate is not valid yet"
    if cert.not_valid_after_utc - now <= renew_before:
        return f"the serving certificate expires at {cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
    if bundle.ca_cert.strip() not in bundle.ca_bundle:
        return "the CA bundle lacks the CA"
    return None


def _live_bundle(current_ca: bytes, older: bytes, now: datetime) -> bytes:
    """``current_ca`` followed by the not yet expired certificates of ``older`` (deduplicated)."""
    out = [current_ca.strip()]
    for cert in _load_certs(older):
        pem = _cert_pem(cert).strip()
        if pem not in out and cert.not_valid_after_utc > now:
            out.append(pem)
    return b"\n".join(out) + b"\n"


def plan_bundle(
    existing: CertBundle | None,
    hostnames: Sequence[str],
    now: datetime,
    renew_before: timedelta = RENEW_BEFORE,
) -> Plan:
    """Decide what the Secret should hold: the existing bundle while it is valid, a new serving
    certificate under the same CA, or a new CA (the old one kept in the bundle while valid)."""
    if existing is None:
        return Plan(new_bundle(hostnames, now), "no certificate yet")
    problem = ca_problem(existing, now, renew_before)
    if problem is not None:
        fresh = new_bundle(hostnames, now)
        bundle_pem = _live_bundle(fresh.ca_cert, existing.ca_bundle, now)
        return Plan(
            CertBundle(fresh.ca_cert, fresh.ca_key, fresh.cert, fresh.key, bundle_pem), problem
        )
    problem = serving_problem(existing, hostnames, now, renew_before)
    if problem is None:
        return Plan(existing, None)
    cert, key = issue_serving_cert(existing.ca_cert, existing.ca_key, hostnames, now)
    bundle_pem = _live_bundle(existing.ca_cert, existing.ca_bundle, now)
    return Plan(CertBundle(existing.ca_cert, existing.ca_key, cert, key, bundle_pem), problem)


def service_hostnames(service: str, namespace: str) -> list[str]:
    """The names the apiserver may use for a Service (it dials ``<svc>.<ns>.svc``)."""
    return [
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        f"{service}.{namespace}",
        service,
    ]


# --------------------------------------------------------------------------- the Secret


def _secret_body(
    namespace: str,
    name: str,
    bundle: CertBundle,
    version: str | None,
    owner: Mapping[str, Any] | None = None,
) -> Any:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/name": "flexgpu", "app.kubernetes.io/component": "webhook"},
    }
    if owner is not None:  # the Secret goes with its owner (the controller's Deployment)
        metadata["ownerReferences"] = [dict(owner)]
    if version is not None:
        metadata["resourceVersion"] = version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "kubernetes.io/tls",
        "data": bundle.to_secret_data(),
    }


def ensure_webhook_secret(
    core: Any,
    namespace: str,
    name: str,
    hostnames: Sequence[str],
    *,
    clock: Clock = utc_now,
    renew_before: timedelta = RENEW_BEFORE,
    owner: Mapping[str, Any] | None = None,
) -> CertBundle:
    """The valid bundle in Secret ``namespace/name``, created or renewed as needed.

    ``core`` is a ``kubernetes.client.CoreV1Api``. Safe to call from several replicas at once:
    every write is conditional (create, or update on the resourceVersion read), and the loser
    of a race re-reads and adopts the winner's bundle when it is valid for ``hostnames``.
    """
    from kubernetes.client.exceptions import ApiException

    for _ in range(_CONFLICT_RETRIES):
        try:
            secret = core.read_namespaced_secret(name, namespace)
        except ApiException as error:
            if error.status != 404:
                raise WebhookTlsError(f"cannot read Secret {namespace}/{name}: {error}") from None
            secret = None
        existing = CertBundle.from_secret_data(secret.data) if secret is not None else None
        plan = plan_bundle(existing, hostnames, clock(), renew_before)
        if not plan.changed:
            return plan.bundle
        try:
            if secret is None:
                core.create_namespaced_secret(
                    namespace, _secret_body(namespace, name, plan.bundle, None, owner)
                )
            else:
                version = secret.metadata.resource_version
                core.replace_namespaced_secret(
                    name, namespace, _secret_body(namespace, name, plan.bundle, version, owner)
                )
        except ApiException as error:
            if error.status in (409, 404):  # lost a race: read what the winner wrote
                continue
            raise WebhookTlsError(f"cannot write Secret {namespace}/{name}: {error}") from None
        logger.info("webhook certificate in Secret %s/%s renewed: %s", namespace, name, plan.reason)
        return plan.bundle
    raise WebhookTlsError(f"Secret {namespace}/{name} kept changing; gave up after retries")


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class CertFiles:
    """Where the server's certificate and key are, and the CA bundle for the apiserver
    (``None`` when unknown: mounted certs without ``ca.crt``)."""

    certfile: Path
    keyfile: Path
    ca_bundle: bytes | None


def _write_atomic(path: Path, data: bytes) -> bool:
    """Replace ``path`` with ``data`` unless it holds it already; True if written."""
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


def write_cert_dir(bundle: CertBundle, folder: Path) -> CertFiles:
    """Write the serving certificate and key as one PEM file (``server.pem``, replaced
    atomically, so a server re-reading it never pairs a new certificate with an old key) and
    the CA bundle (``ca.crt``) into ``folder`` (created ``0700``)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    combined = folder / SERVER_PEM
    _write_atomic(combined, bundle.cert.rstrip() + b"\n" + bundle.key)
    _write_atomic(folder / CA_CERT_KEY, bundle.ca_bundle)
    return CertFiles(combined, combined, bundle.ca_bundle)


def read_cert_dir(folder: Path) -> CertFiles:
    """Mounted certificates (cert-manager's Secret layout): ``tls.crt``, ``tls.key`` and, if
    present, ``ca.crt``."""
    certfile, keyfile, cafile = folder / TLS_CERT_KEY, folder / TLS_KEY_KEY, folder / CA_CERT_KEY
    for path in (certfile, keyfile):
        if not path.is_file():
            raise WebhookTlsError(f"{path} is missing (expected tls.crt, tls.key, ca.crt)")
    ca_bundle = cafile.read_bytes() if cafile.is_file() else None
    return CertFiles(certfile, keyfile, ca_bundle or None)
