"""The admission webhook alone, as a process: ``python -m flexgpu.controller.admission_server``.

For the local test world (the controller is a local process and the apiserver calls it at a
URL) and for running the webhook apart from the rest of the controller::

    python -m flexgpu.controller.admission_server --kubeconfig KUBECONFIG --listen 127.0.0.1:9443 \\
        [--webhook-secret-namespace flexgpu-system --webhook-secret-name flexgpu-webhook-tls] \\
        [--webhook-cert-dir DIR] [--webhook-url-host HOST] \\
        [--webhook-configuration-name flexgpu-validation]

In-cluster (no ``--kubeconfig``), pass ``--webhook-service-name`` (and
``--webhook-service-namespace``) so the configuration names the Service instead of a URL.
``add_webhook_arguments``/``options_from_args`` give the controller's CLI the same flags.
(Tests start this process with ``tests/integration/webhook_process.py``.)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kopf

from flexgpu.controller.gpu_tolerations import DEFAULT_GPU_TOLERATIONS, parse_tolerations
from flexgpu.controller.kopf_login import connection_info
from flexgpu.controller.webhook_config import CONFIGURATION_NAME, ServiceRef
from flexgpu.controller.webhook_server import WebhookOptions, configure_webhook

logger = logging.getLogger(__name__)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _tolerations(text: str) -> list[dict[str, Any]]:
    try:
        return parse_tolerations(json.loads(text), "--gpu-tolerations")
    except ValueError as error:  # TolerationError and JSONDecodeError are ValueErrors
        raise argparse.ArgumentTypeError(str(error)) from None


def add_webhook_arguments(parser: argparse.ArgumentParser) -> None:
    """The webhook's flags (``--webhook-*``); ``options_from_args`` turns them into
    ``WebhookOptions``. The controller's CLI can add the same flags."""
    group = parser.add_argument_group("admission webhook")
    group.add_argument(
        "--webhook-listen",
        "--listen",
        dest="webhook_listen",
        type=_host_port,
        default=("0.0.0.0", 9443),
        metavar="HOST:PORT",
        help="where to serve HTTPS (default 0.0.0.0:9443)",
    )
    group.add_argument(
        "--webhook-url-host",
        help="local mode: host in the webhook URL https://HOST:PORT (default: the listen host)",
    )
    group.add_argument(
        "--webhook-service-name",
        help="in-cluster: the webhook Service (the configuration names it instead of a URL)",
    )
    group.add_argument(
        "--webhook-service-namespace", help="the Service's namespace (default: the Secret's)"
    )
    group.add_argument("--webhook-service-port", type=int, default=443)
    group.add_argument(
        "--webhook-cert-dir",
        type=Path,
        help="use tls.crt, tls.key (and ca.crt) from this folder as is, e.g. mounted by "
        "cert-manager; the Secret is then not touched",
    )
    group.add_argument("--webhook-secret-namespace", default="flexgpu-system")
    group.add_argument("--webhook-secret-name", default="flexgpu-webhook-tls")
    group.add_argument("--webhook-configuration-name", default=CONFIGURATION_NAME)
    group.add_argument(
        "--tenant-webhook-configuration-name",
        default="",
        metavar="NAME",
        help="the MutatingWebhookConfiguration that adds the per-namespace selector to "
        "shared-GPU claims (default: none, namespaces may share GPUs)",
    )
    group.add_argument(
        "--toleration-webhook-configuration-name",
        default="",
        metavar="NAME",
        help="the MutatingWebhookConfiguration that adds --gpu-tolerations to pods using "
        "flexgpu's claims (default: none)",
    )
    group.add_argument(
        "--gpu-tolerations",
        type=_tolerations,
        default=list(DEFAULT_GPU_TOLERATIONS),
        metavar="JSON",
        help="the tolerations added to pods using flexgpu's claims, a JSON list (default: "
        + json.dumps(list(DEFAULT_GPU_TOLERATIONS))
        + ")",
    )
    group.add_argument(
        "--toleration-failure-policy",
        choices=("Ignore", "Fail"),
        default="Ignore",
        help="failurePolicy of that configuration when this process writes it (default Ignore)",
    )
    group.add_argument(
        "--no-webhook-configuration",
        dest="webhook_manage_configuration",
        action="store_false",
        help="do not create or update the ValidatingWebhookConfiguration",
    )
    group.add_argument(
        "--webhook-ca-bundle-only",
        action="store_true",
        help="the configuration is installed by someone else (the Helm chart): only fill in "
        "its caBundle, never create or rewrite it",
    )
    group.add_argument(
        "--webhook-resync-interval",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="how often the Secret is checked for renewal (default 3600)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flexgpu.controller.admission_server",
        description="flexgpu validating admission webhook (kopf)",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    parser.add_argument("--verbose", "-v", action="store_true")
    add_webhook_arguments(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> WebhookOptions:
    service = None
    if args.webhook_service_name:
        namespace = args.webhook_service_namespace or args.webhook_secret_namespace
        service = ServiceRef(
            namespace=namespace, name=args.webhook_service_name, port=args.webhook_service_port
        )
    addr, port = args.webhook_listen
    return WebhookOptions(
        listen_addr=addr,
        port=port,
        service=service,
        url_host=args.webhook_url_host,
        cert_dir=args.webhook_cert_dir,
        secret_namespace=args.webhook_secret_namespace,
        secret_name=args.webhook_secret_name,
        configuration_name=args.webhook_configuration_name,
        tenant_configuration_name=args.tenant_webhook_configuration_name or None,
        toleration_configuration_name=args.toleration_webhook_configuration_name or None,
        gpu_tolerations=args.gpu_tolerations,
        toleration_failure_policy=args.toleration_failure_policy,
        manage_configuration=args.webhook_manage_configuration,
        ca_bundle_only=args.webhook_ca_bundle_only,
        resync_interval_s=args.webhook_resync_interval,
    )


def main(argv: Sequence[str] | None = None) -> int:
    from kubernetes import client, config

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    options = options_from_args(args)
    if args.kubeconfig:
        api_client = config.new_client_from_config(config_file=args.kubeconfig)
    else:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        api_client = client.ApiClient(configuration)

    registry = kopf.OperatorRegistry()

    if args.kubeconfig:

        @kopf.on.login(registry=registry)
        def _login(**_: Any) -> kopf.ConnectionInfo:
            return connection_info(api_client.configuration)

    else:
        kopf.on.login(registry=registry)(kopf.login_with_service_account)

    @kopf.on.startup(registry=registry)
    def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False
        configure_webhook(settings, options, api_client)

    kopf.run(registry=registry, standalone=True, clusterwide=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
