"""The admission webhook server: certificates, the HTTPS endpoint and the
ValidatingWebhookConfiguration, with no manual steps.

``configure_webhook(settings, options, api_client)`` (call it from a ``@kopf.on.startup``
handler) sets ``settings.admission.server`` to a ``FlexgpuWebhookServer``. When kopf starts
it, the server:

1. gets its certificate: from ``options.cert_dir`` as is (cert-manager), or from the Secret
   ``options.secret_namespace/options.secret_name``, created or renewed as needed
   (``controller.webhook_tls``) and written to a private folder;
2. serves HTTPS (``AdmissionHttpsServer``) on ``options.listen_addr:options.port``, one path per
   handler id, answering with ``controller.admission.answer_admission_review``;
3. applies the ValidatingWebhookConfiguration (``controller.webhook_config``) with the CA
   bundle and a Service reference (in-cluster) or a URL (local process);
4. every ``options.resync_interval_s`` re-checks the Secret (renewal, or another replica's
   renewal) and, when it changed, updates the configuration's CA bundle first and then the
   served certificate (kopf reloads the files).

Every replica runs the server (the Service spreads requests over all of them); the Secret and
the configuration converge because every write is conditional and every replica writes the
same content once the Secret is settled.

What kopf is used for here: running the server for as long as the operator runs, through its
public ``settings.admission.server`` hook (``kopf.WebhookServerProtocol``). Nothing else:
kopf's admission engine would route each review to a registered handler that calls the same
pure checks ``answer_admission_review`` calls, after its own discovery of the resources (which
misses a CRD created after start, answering 404), and its HTTPS server answers malformed
bodies with ``allowed: true``; neither is reachable through kopf's public API without its
private modules. So the server here parses, routes and answers reviews itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import socket
import ssl
import tempfile
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from flexgpu.controller.admission import answer_admission_review
from flexgpu.controller.admission_review import Refusal, parse_review
from flexgpu.controller.gpu_tolerations import GPU_TOLERATIONS_HANDLER, answer_toleration_review
from flexgpu.controller.pod_claim_lookup import ApiClaimLookup
from flexgpu.controller.tenant_selector import TENANT_HANDLERS, answer_tenant_review
from flexgpu.controller.tenant_webhook_config import build_tenant_webhook_configuration
from flexgpu.controller.toleration_webhook_config import build_toleration_webhook_configuration
from flexgpu.controller.webhook_config import (
    CONFIGURATION_NAME,
    DEFAULT_NAMESPACE_SELECTOR,
    ClientTarget,
    FailurePolicy,
    ServiceRef,
    apply_webhook_configuration,
    build_webhook_configuration,
    patch_ca_bundle,
)
from flexgpu.controller.webhook_tls import (
    CertBundle,
    CertFiles,
    ensure_webhook_secret,
    read_cert_dir,
    service_hostnames,
    write_cert_dir,
)
from flexgpu.driver.user_text import shorten

logger = logging.getLogger(__name__)


@dataclass
class WebhookOptions:
    """How the webhook is served and reached.

    In-cluster: set ``service`` (the apiserver calls ``<name>.<namespace>.svc:<port>``; the
    certificate covers the Service's names). Local process: leave ``service`` unset; the
    apiserver calls ``https://<url_host>:<port>`` (``url_host`` defaults to ``listen_addr``).
    """

    listen_addr: str = "0.0.0.0"
    port: int = 9443
    service: ServiceRef | None = None
    url_host: str | None = None
    cert_dir: Path | None = None  # mounted certs (cert-manager): used as is
    secret_namespace: str = "flexgpu-system"
    secret_name: str = "flexgpu-webhook-tls"
    work_dir: Path | None = None  # where Secret-mode certs are written; a temp dir if None
    configuration_name: str = CONFIGURATION_NAME
    # The MutatingWebhookConfiguration adding the tenant selector (tenant_webhook_config.py);
    # None: none (namespaces may share GPUs).
    tenant_configuration_name: str | None = None
    # The MutatingWebhookConfiguration adding GPU-node tolerations to pods using flexgpu's
    # claims (toleration_webhook_config.py), and the tolerations; None: none.
    toleration_configuration_name: str | None = None
    gpu_tolerations: list[dict[str, Any]] = field(default_factory=list)
    toleration_failure_policy: FailurePolicy = "Ignore"
    manage_configuration: bool = True
    # The configuration is installed by the chart: only its caBundle is patched.
    ca_bundle_only: bool = False
    # ownerReference for the certificate Secret (controller/owner.py).
    owner: dict[str, Any] | None = None
    namespace_selector: dict[str, Any] | None = field(
        default_factory=lambda: dict(DEFAULT_NAMESPACE_SELECTOR)
    )
    object_selector: dict[str, Any] | None = None
    resync_interval_s: float = 3600.0
    file_check_interval_s: float = 10.0

    @property
    def hostnames(self) -> list[str]:
        """The names the serving certificate must cover."""
        if self.service is not None:
            return service_hostnames(self.service.name, self.service.namespace)
        return [self.reach_host]

    @property
    def target(self) -> ClientTarget:
        return self.target_at(self.port)

    def target_at(self, port: int) -> ClientTarget:
        """The target when the server listens on ``port`` (``port`` 0 asks for any free
        port; the configuration must then name the one actually bound)."""
        if self.service is not None:
            return self.service
        host = self.reach_host
        shown = f"[{host}]" if ":" in host else host
        return f"https://{shown}:{port}"

    @property
    def reach_host(self) -> str:
        """The host the apiserver dials in local mode."""
        if self.url_host:
            return self.url_host
        return "127.0.0.1" if self.listen_addr in ("", "0.0.0.0") else self.listen_addr


class FlexgpuWebhookServer:
    """A kopf webhook server (``settings.admission.server``): yields kopf's client configs,
    after making sure the ValidatingWebhookConfiguration points at this server."""

    def __init__(self, options: WebhookOptions, api_client: Any) -> None:
        from kubernetes import client

        self.options = options
        self._core = client.CoreV1Api(api_client)
        self._admission = client.AdmissionregistrationV1Api(api_client)
        self._bundle: CertBundle | None = None
        self._files: CertFiles | None = None
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        # The port actually listened on: options.port, or the one bound for port 0.
        self.bound_port: int | None = None

    # -- certificates -------------------------------------------------------------------

    def _work_dir(self) -> Path:
        if self.options.work_dir is not None:
            return self.options.work_dir
        if self._tempdir is None:
            self._tempdir = tempfile.TemporaryDirectory(prefix="flexgpu-webhook-")
        return Path(self._tempdir.name)

    def load_certificates(self) -> CertFiles:
        """Blocking: read the mounted certs, or ensure the Secret and write its files."""
        if self.options.cert_dir is not None:
            self._files = read_cert_dir(self.options.cert_dir)
            return self._files
        bundle = ensure_webhook_secret(
            self._core,
            self.options.secret_namespace,
            self.options.secret_name,
            self.options.hostnames,
            owner=self.options.owner,
        )
        return self._use_bundle(bundle)

    def _use_bundle(self, bundle: CertBundle) -> CertFiles:
        self._bundle = bundle
        self._files = write_cert_dir(bundle, self._work_dir())
        return self._files

    def apply_configuration(self, ca_bundle: bytes | None) -> None:
        """Blocking: create or update the ValidatingWebhookConfiguration (and the tenancy
        MutatingWebhookConfiguration when one is named)."""
        if not self.options.manage_configuration:
            return
        if self.options.ca_bundle_only:
            if ca_bundle is not None:
                patch_ca_bundle(self._admission, self.options.configuration_name, ca_bundle)
                if self.options.tenant_configuration_name:
                    patch_ca_bundle(
                        self._admission,
                        self.options.tenant_configuration_name,
                        ca_bundle,
                        "mutating",
                    )
                if self.options.toleration_configuration_name:
                    patch_ca_bundle(
                        self._admission,
                        self.options.toleration_configuration_name,
                        ca_bundle,
                        "mutating",
                    )
            return
        port = self.bound_port if self.bound_port is not None else self.options.port
        body = build_webhook_configuration(
            self.options.target_at(port),
            ca_bundle,
            name=self.options.configuration_name,
            namespace_selector=self.options.namespace_selector,
            object_selector=self.options.object_selector,
        )
        apply_webhook_configuration(self._admission, body)
        if self.options.tenant_configuration_name:
            tenancy = build_tenant_webhook_configuration(
                self.options.target_at(port),
                ca_bundle,
                name=self.options.tenant_configuration_name,
                object_selector=self.options.object_selector,
            )
            apply_webhook_configuration(self._admission, tenancy)
        if self.options.toleration_configuration_name:
            tolerations = build_toleration_webhook_configuration(
                self.options.target_at(port),
                ca_bundle,
                name=self.options.toleration_configuration_name,
                failure_policy=self.options.toleration_failure_policy,
                namespace_selector=self.options.namespace_selector,
                object_selector=self.options.object_selector,
            )
            apply_webhook_configuration(self._admission, tolerations)

    async def _resync_forever(self) -> None:
        """Secret mode: pick up renewals (ours when due, or another replica's)."""
        while True:
            await asyncio.sleep(self.options.resync_interval_s)
            try:
                bundle = await asyncio.to_thread(
                    functools.partial(ensure_webhook_secret, owner=self.options.owner),
                    self._core,
                    self.options.secret_namespace,
                    self.options.secret_name,
                    self.options.hostnames,
                )
                if bundle == self._bundle:
                    continue
                # The new bundle trusts both the old and the new certificate: publish it before
                # the server switches certificates.
                await asyncio.to_thread(self.apply_configuration, bundle.ca_bundle)
                await asyncio.to_thread(self._use_bundle, bundle)
                logger.info("webhook certificate replaced; the server reloads it")
            except Exception:
                logger.exception("webhook certificate resync failed; retrying later")

    def _answer_pod(self, review: Mapping[str, Any]) -> dict[str, Any] | None:
        """The pod toleration webhook's answer; reads go through this server's client."""
        lookup = ApiClaimLookup(self._core.api_client)
        return answer_toleration_review(self.options.gpu_tolerations, lookup, review)

    # -- the kopf server protocol ---------------------------------------------------------

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        """kopf's server protocol. ``fn`` (kopf's admission engine) is not used: reviews are
        answered by ``answer_admission_review`` (see the module docstring)."""
        files = await asyncio.to_thread(self.load_certificates)
        inner = AdmissionHttpsServer(
            addr=self.options.listen_addr or None,
            port=self.options.port,
            host=self.options.reach_host,
            certfile=files.certfile,
            keyfile=files.keyfile,
            cadata=files.ca_bundle,
            file_check_interval_s=self.options.file_check_interval_s,
            pod_answer=self._answer_pod,
        )
        resync: asyncio.Task[None] | None = None
        if self.options.cert_dir is None:
            resync = asyncio.create_task(self._resync_forever())
        try:
            async for client_config in inner():
                # The URL carries the port bound (a free one when options.port is 0).
                self.bound_port = urllib.parse.urlsplit(client_config["url"]).port
                if self.options.cert_dir is not None:
                    # Mounted certs were renewed (the server reloaded them): re-read ca.crt.
                    files = await asyncio.to_thread(read_cert_dir, self.options.cert_dir)
                ca_bundle = self._bundle.ca_bundle if self._bundle else files.ca_bundle
                await asyncio.to_thread(self.apply_configuration, ca_bundle)
                logger.info(
                    "admission webhook serving on %s:%s, reached at %s",
                    self.options.listen_addr,
                    self.bound_port,
                    self.options.target_at(self.bound_port or self.options.port),
                )
                yield client_config
        finally:
            if resync is not None:
                resync.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await resync
            if self._tempdir is not None:
                self._tempdir.cleanup()
                self._tempdir = None


def _refuse(refusal: Refusal) -> aiohttp.web.Response:
    return aiohttp.web.Response(status=refusal.status, text=refusal.reason + "\n")


Answer = Callable[[Mapping[str, Any]], "dict[str, Any] | None"]


class AdmissionHttpsServer:
    """The HTTPS endpoint (aiohttp), answering only well-formed AdmissionReviews
    (``controller.admission_review``) for our resources: anything else gets a 4xx with a
    one-line reason, a review of a resource we do not check 404, never a default
    ``allowed: true``; an unexpected failure in ``answer`` a 500 with a short text (the
    traceback goes to the log only).

    Iterating ``server()`` starts it and yields the client config (URL and CA bundle) to put in
    the webhook configuration; it yields again after the certificate files changed (checked
    every ``file_check_interval_s``; new connections get the new certificate). ``certfile``
    None serves plain HTTP (tests). Stops when the iteration is closed or cancelled.
    """

    def __init__(
        self,
        *,
        addr: str | None,
        port: int,
        host: str,
        certfile: Path | None = None,
        keyfile: Path | None = None,
        cadata: bytes | None = None,
        file_check_interval_s: float = 10.0,
        answer: Answer = answer_admission_review,
        pod_answer: Answer | None = None,
    ) -> None:
        self.addr, self.port, self.host = addr, port, host
        self.certfile, self.keyfile, self.cadata = certfile, keyfile, cadata
        self.file_check_interval_s = file_check_interval_s
        self.answer = answer
        self.pod_answer = pod_answer

    async def __call__(self) -> AsyncIterator[kopf.WebhookClientConfig]:
        context = self._ssl_context()
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.post("/{id:.*}", self._serve)])
        runner = aiohttp.web.AppRunner(app, handle_signals=False)
        await runner.setup()
        try:
            # Our own socket: with port 0 the port actually bound is read from it.
            family = socket.AF_INET6 if ":" in (self.addr or "") else socket.AF_INET
            sock = socket.create_server((self.addr or "", self.port), family=family)
            site = aiohttp.web.SockSite(runner, sock, ssl_context=context)
            await site.start()
            port = int(sock.getsockname()[1])
            shown = f"[{self.host}]" if ":" in self.host else self.host
            config = kopf.WebhookClientConfig(
                url=f"{'https' if context else 'http'}://{shown}:{port}/"
            )
            if self.cadata is not None:
                config["caBundle"] = base64.b64encode(self.cadata).decode("ascii")
            stamp = self._stamp()
            yield config
            if context is None:
                await asyncio.Event().wait()  # plain HTTP: no certificate to follow
            while True:
                while self._stamp() == stamp:
                    await asyncio.sleep(self.file_check_interval_s)
                stamp = self._stamp()
                assert context is not None and self.certfile and self.keyfile
                try:
                    context.load_cert_chain(self.certfile, self.keyfile)
                except (ssl.SSLError, OSError) as err:
                    # Caught between writing the key and the certificate: the next change
                    # completes the pair; until then the loaded one is served.
                    logger.warning("webhook certificate files not usable yet: %s", err)
                    continue
                logger.info("webhook certificate files changed; serving the new certificate")
                yield config
        finally:
            await runner.cleanup()

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.certfile is None or self.keyfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile)
        return context

    def _stamp(self) -> tuple[float, ...]:
        files = [f for f in (self.certfile, self.keyfile) if f is not None]
        with contextlib.suppress(OSError):
            return tuple(f.stat().st_mtime for f in files)
        return ()

    async def _serve(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        handler_id = request.match_info.get("id", "")
        try:
            raw = await request.read()  # 413 past aiohttp's body limit (1 MiB)
        except aiohttp.web.HTTPException as error:
            return _refuse(Refusal(error.status, error.reason))
        body, refusal = parse_review(raw, handler_id)
        if refusal is not None or body is None:
            return _refuse(refusal or Refusal(400, "no AdmissionReview"))
        answer_fn: Answer = self.answer
        if handler_id in TENANT_HANDLERS:
            answer_fn = functools.partial(answer_tenant_review, handler_id)
        elif handler_id == GPU_TOLERATIONS_HANDLER:
            if self.pod_answer is None:
                return _refuse(Refusal(404, "this server adds no GPU tolerations"))
            answer_fn = self.pod_answer
        try:
            answer = await asyncio.to_thread(answer_fn, body)
        except Exception:
            logger.exception("admission request %s failed", body["request"]["uid"][:64])
            return _refuse(Refusal(500, "internal error in the admission webhook"))
        if answer is None:
            resource = body["request"].get("resource")
            return _refuse(Refusal(404, shorten(f"not a resource this webhook checks: {resource}")))
        if not answer["response"]["allowed"]:
            logger.info("refused %s: %s", handler_id, answer["response"]["status"]["message"])
        return aiohttp.web.json_response(answer, dumps=json.dumps)


def configure_webhook(
    settings: kopf.OperatorSettings, options: WebhookOptions, api_client: Any
) -> FlexgpuWebhookServer:
    """Serve the admission webhook from this operator (kopf does not manage the configuration;
    ``FlexgpuWebhookServer`` does). ``api_client`` is a ``kubernetes.client.ApiClient``."""
    server = FlexgpuWebhookServer(options, api_client)
    settings.admission.server = server
    settings.admission.managed = None
    return server
