"""The admission webhook server for kopf: certificates, the HTTPS endpoint and the
ValidatingWebhookConfiguration, with no manual steps.

``configure_webhook(settings, options, api_client)`` (call it from a ``@kopf.on.startup``
handler, next to ``controller.admission.register_admission(registry)``) sets
``settings.admission.server`` to a ``FlexgpuWebhookServer``. When kopf starts it, the server:

1. gets its certificate: from ``options.cert_dir`` as is (cert-manager), or from the Secret
   ``options.secret_namespace/options.secret_name``, created or renewed as needed
   (``controller.webhook_tls``) and written to a private folder;
2. serves HTTPS with ``kopf.WebhookServer`` on ``options.listen_addr:options.port`` (one path
   per handler id);
3. applies the ValidatingWebhookConfiguration (``controller.webhook_config``) with the CA
   bundle and a Service reference (in-cluster) or a URL (local process);
4. every ``options.resync_interval_s`` re-checks the Secret (renewal, or another replica's
   renewal) and, when it changed, updates the configuration's CA bundle first and then the
   served certificate (kopf reloads the files).

Every replica runs the server (the Service spreads requests over all of them); the Secret and
the configuration converge because every write is conditional and every replica writes the
same content once the Secret is settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp.web
import kopf
from kopf._cogs.structs.reviews import Request, Response
from kopf._core.engines.admission import UnknownResourceError, WebhookError

from controller.admission import answer_admission_review
from controller.admission_review import Refusal, parse_review
from controller.webhook_config import (
    CONFIGURATION_NAME,
    DEFAULT_NAMESPACE_SELECTOR,
    ClientTarget,
    ServiceRef,
    apply_webhook_configuration,
    build_webhook_configuration,
    patch_ca_bundle,
)
from controller.webhook_tls import (
    CertBundle,
    CertFiles,
    ensure_webhook_secret,
    read_cert_dir,
    service_hostnames,
    write_cert_dir,
)
from driver.user_text import shorten

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
    manage_configuration: bool = True
    # The configuration is installed by the chart: only its caBundle is patched.
    ca_bundle_only: bool = False
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
        )
        return self._use_bundle(bundle)

    def _use_bundle(self, bundle: CertBundle) -> CertFiles:
        self._bundle = bundle
        self._files = write_cert_dir(bundle, self._work_dir())
        return self._files

    def apply_configuration(self, ca_bundle: bytes | None) -> None:
        """Blocking: create or update the ValidatingWebhookConfiguration."""
        if not self.options.manage_configuration:
            return
        if self.options.ca_bundle_only:
            if ca_bundle is not None:
                patch_ca_bundle(self._admission, self.options.configuration_name, ca_bundle)
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

    async def _resync_forever(self) -> None:
        """Secret mode: pick up renewals (ours when due, or another replica's)."""
        while True:
            await asyncio.sleep(self.options.resync_interval_s)
            try:
                bundle = await asyncio.to_thread(
                    ensure_webhook_secret,
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

    # -- the kopf server protocol ---------------------------------------------------------

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        files = await asyncio.to_thread(self.load_certificates)
        inner = GuardedWebhookServer(
            addr=self.options.listen_addr or None,
            port=self.options.port,
            host=self.options.reach_host,
            certfile=str(files.certfile),
            pkeyfile=str(files.keyfile),
            cadata=files.ca_bundle,
            file_check_interval=self.options.file_check_interval_s,
        )
        resync: asyncio.Task[None] | None = None
        if self.options.cert_dir is None:
            resync = asyncio.create_task(self._resync_forever())
        try:
            async for client_config in inner(with_discovery_fallback(fn)):
                # kopf's URL carries the port it bound (a free one when options.port is 0).
                self.bound_port = urllib.parse.urlsplit(client_config["url"]).port
                if self.options.cert_dir is not None:
                    # Mounted certs were renewed (kopf restarted on the change): re-read ca.crt.
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


class GuardedWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, answering only well-formed AdmissionReviews at the paths
    of our handlers (``controller.admission_review``): anything else gets a 4xx with a
    one-line reason, an unknown path 404, never a default ``allowed: true``; an unexpected
    failure inside a handler a 500 with a short text (the traceback goes to the log only)."""

    @staticmethod
    async def _serve(fn: kopf.WebhookFn, request: aiohttp.web.Request) -> aiohttp.web.Response:
        handler_id = request.match_info.get("id", "")
        try:
            raw = await request.read()  # 413 past aiohttp's body limit (1 MiB)
        except aiohttp.web.HTTPException as error:
            return _refuse(Refusal(error.status, error.reason))
        body, refusal = parse_review(raw, handler_id)
        if refusal is not None or body is None:
            return _refuse(refusal or Refusal(400, "no AdmissionReview"))
        sslpeer = request.transport.get_extra_info("peercert") if request.transport else None
        try:
            response = await fn(
                cast(Request, body),
                webhook=handler_id,
                headers=dict(request.headers),
                sslpeer=sslpeer,
            )
        except UnknownResourceError as error:
            return _refuse(Refusal(404, shorten(str(error))))
        except WebhookError as error:
            return _refuse(Refusal(400, shorten(str(error))))
        except Exception:
            logger.exception("admission request %s failed", body["request"]["uid"][:64])
            return _refuse(Refusal(500, "internal error in the admission webhook"))
        return aiohttp.web.json_response(response, dumps=json.dumps)


def with_discovery_fallback(fn: kopf.WebhookFn) -> kopf.WebhookFn:
    """``fn``, but a request for one of our resources that kopf does not know yet (its
    discovery missed a CRD created after start) is answered by the same checks directly
    instead of failing with 404 (which a ``Fail`` webhook would turn into a refusal)."""

    async def serve(
        request: Request,
        *,
        webhook: str | None = None,
        headers: kopf.Headers | None = None,
        sslpeer: kopf.SSLPeer | None = None,
    ) -> Response:
        try:
            return await fn(request, webhook=webhook, headers=headers, sslpeer=sslpeer)
        except UnknownResourceError:
            answer = answer_admission_review(request)
            if answer is None:
                raise
            return cast(Response, answer)

    return serve


class _RejectionsAreNotErrors(logging.Filter):
    """kopf logs every handler exception at ERROR; a rejected object is routine, so its
    record goes out at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (
            record.levelno == logging.ERROR
            and message.startswith("Webhook ")
            and ("failed permanently" in message)
        ):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_REJECTION_FILTER = _RejectionsAreNotErrors()


def configure_webhook(
    settings: kopf.OperatorSettings, options: WebhookOptions, api_client: Any
) -> FlexgpuWebhookServer:
    """Serve the admission webhook from this operator (kopf does not manage the configuration;
    ``FlexgpuWebhookServer`` does). ``api_client`` is a ``kubernetes.client.ApiClient``."""
    server = FlexgpuWebhookServer(options, api_client)
    logging.getLogger("kopf.objects").addFilter(_REJECTION_FILTER)  # idempotent
    settings.admission.server = server
    settings.admission.managed = None
    return server
