"""``flexgpu-controller``: the cluster controller process.

kopf runs the process (signals, start-up and clean-up, credentials, the liveness endpoint and
the admission webhook, unless ``--no-webhook``), with an explicit ``kopf.OperatorRegistry``
so nothing registers itself by import side effect. The controller's own work does not go
through kopf's resource handlers: the cache needs list-then-watch with deletions reconciled on
re-list, and the active work must start and stop with our Lease, not with kopf's peering; both
run in threads (``controller.app``) that kopf starts and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import kopf

from flexgpu.controller import kube
from flexgpu.controller.admission_server import add_webhook_arguments, options_from_args
from flexgpu.controller.app import Controller, ControllerConfig
from flexgpu.controller.binding_waits import DEFAULT_GRACE_S
from flexgpu.controller.clearing import DEFAULT_MAX_S
from flexgpu.controller.diagnostics import DEFAULT_RECHECK_S, DEFAULT_REEMIT_S
from flexgpu.controller.kopf_login import connection_info
from flexgpu.controller.owner import deployment_owner
from flexgpu.controller.place_eviction import DEFAULT_MAX_IN_FLIGHT
from flexgpu.controller.webhook_server import WebhookOptions, configure_webhook
from flexgpu.driver.allocation.node_clearing import DEFAULT_MAX_HELD_SHARE
from flexgpu.driver.durations import human_duration, parse_duration
from flexgpu.driver.log_format import FORMATS, LEVELS, configure_logging

log = logging.getLogger("flexgpu.controller")

DEFAULT_NAMESPACE = "flexgpu-system"
DEFAULT_LEASE = "flexgpu-controller"


def _default_identity() -> str:
    # In a pod, the pod name is unique and readable in `kubectl get lease`.
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def _fraction(flag: str, allowed: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: must be a number from {allowed}")
        return value

    return parse


def _node_labels(text: str) -> dict[str, str]:
    """``key=value[,key=value]``: the labels a node must all carry."""
    labels: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.partition("=")
        if not part or not sep or not key.strip() or "=" in value:
            raise argparse.ArgumentTypeError(
                f"--node-steering-nodes {text!r}: {part!r} is not key=value; allowed is "
                "key=value[,key=value] (the labels a node must all carry)"
            )
        labels[key.strip()] = value.strip()
    return labels


def _positive_duration(flag: str, example: str = "1h") -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = parse_duration(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{flag}: {err}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(
                f"{flag} {text!r}: must be a duration of more than 0, such as {example}"
            )
        return value

    return parse


def _in_flight(flag: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{flag} {text!r}: must be a whole number of 1 or more"
            )
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexgpu-controller",
        description="flexgpu cluster controller: diagnostics for GPU claims that cannot be "
        "allocated, pool metrics, GpuNodePolicy status, GPU clearing, node steering, "
        "admission webhook",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster credentials)")
    parser.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", DEFAULT_NAMESPACE),
        help="namespace of the controller's own objects (default: $POD_NAMESPACE or "
        f"{DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--pending-delay",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="explain a pod's claims once it has been Pending this long (default 30)",
    )
    parser.add_argument(
        "--recheck-interval",
        type=float,
        default=DEFAULT_RECHECK_S,
        metavar="SECONDS",
        help="re-explain a pending claim at most this often, when the cluster changed",
    )
    parser.add_argument(
        "--reemit-interval",
        type=float,
        default=DEFAULT_REEMIT_S,
        metavar="SECONDS",
        help="repeat an unchanged diagnosis Event after this long (default 1800)",
    )
    parser.add_argument(
        "--binding-grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="record GpuBindingConditionPending once a pod has waited this long for flexgpu's "
        f"binding conditions (Kubernetes 1.36+; default {DEFAULT_GRACE_S:.0f})",
    )
    parser.add_argument(
        "--clearing-share",
        type=_fraction("--clearing-share", "0 (off) to 1"),
        default=0.0,
        metavar="FRACTION",
        help="keep new claims off at most this share of the cluster's GPUs so they empty for "
        "claims that wait on fragmented capacity, e.g. 0.1 (default 0: off)",
    )
    parser.add_argument(
        "--clearing-max",
        type=parse_duration,
        default=DEFAULT_MAX_S,
        metavar="DURATION",
        help="stop keeping a GPU clear after this long, e.g. 1h (default 1h)",
    )
    parser.add_argument(
        "--clearing-evict-after",
        type=_positive_duration("--clearing-evict-after", "10m"),
        metavar="DURATION",
        help='evict the pods that opted in (flexgpu.dev/movable: "true", owned by a '
        "ReplicaSet, StatefulSet or ReplicationController) from a GPU kept clear this long, "
        "e.g. 10m; less than --clearing-max (default: never evict)",
    )
    parser.add_argument(
        "--clearing-evict-max-in-flight",
        type=_in_flight("--clearing-evict-max-in-flight"),
        default=DEFAULT_MAX_IN_FLIGHT,
        metavar="N",
        help=f"at most this many such pods being evicted at once (default {DEFAULT_MAX_IN_FLIGHT})",
    )
    parser.add_argument(
        "--node-steering-share",
        type=_fraction("--node-steering-share", "0 (off) to 1"),
        default=0.0,
        metavar="FRACTION",
        help="keep new claims off the nodes closest to empty, at most this share of the "
        "cluster's GPUs, so an autoscaler can remove them, e.g. 0.5; for autoscaled groups "
        "only (default 0: off)",
    )
    parser.add_argument(
        "--node-steering-max-held-share",
        type=_fraction("--node-steering-max-held-share", "0 (only empty nodes) to 1"),
        default=DEFAULT_MAX_HELD_SHARE,
        metavar="FRACTION",
        help="steer only nodes whose claims hold at most this share of their GPUs "
        f"(default {DEFAULT_MAX_HELD_SHARE})",
    )
    parser.add_argument(
        "--node-steering-nodes",
        type=_node_labels,
        default={},
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="steer only nodes with all these labels, the autoscaled group (default: every "
        "node with flexgpu GPUs); the group's room is counted on these nodes alone",
    )
    parser.add_argument(
        "--node-steering-max",
        type=_positive_duration("--node-steering-max"),
        default=DEFAULT_MAX_S,
        metavar="DURATION",
        help="stop steering a node after this long, and not again for as long (default 1h)",
    )
    parser.add_argument(
        "--node-steering-evict-after",
        type=_positive_duration("--node-steering-evict-after", "10m"),
        metavar="DURATION",
        help='evict the pods that opted in (flexgpu.dev/movable: "true", owned by a '
        "ReplicaSet, StatefulSet or ReplicationController) from a node steered this long, when "
        "every holder of the node may move and fits elsewhere, e.g. 10m; less than "
        "--node-steering-max (default: never evict)",
    )
    parser.add_argument(
        "--node-steering-evict-max-in-flight",
        type=_in_flight("--node-steering-evict-max-in-flight"),
        default=DEFAULT_MAX_IN_FLIGHT,
        metavar="N",
        help="at most this many pods being evicted from steered nodes at once, apart from "
        f"GPU clearing's (default {DEFAULT_MAX_IN_FLIGHT})",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=8080, help="Prometheus endpoint port; 0 turns it off"
    )
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address to serve metrics on")
    parser.add_argument("--lease-name", default=DEFAULT_LEASE, help="leader election Lease name")
    parser.add_argument("--lease-namespace", help="namespace of the Lease (default: --namespace)")
    parser.add_argument(
        "--identity", help="this replica's name in the Lease (default: pod name or host + id)"
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=0,
        help="serve kopf's liveness probe on this port at /healthz (0: off)",
    )
    parser.add_argument(
        "--plugin-metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="kubelet plugins' metrics endpoint (a name stands for all its addresses, e.g. the "
        "chart's headless plugin metrics Service); repeatable",
    )
    parser.add_argument(
        "--idle-window",
        type=parse_duration,
        metavar="DURATION",
        help="record IdleGpuClaim Events for claims idle this long, e.g. 2h (needs "
        "--plugin-metrics)",
    )
    parser.add_argument(
        "--idle-check-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how often the leader reads the plugins for idle claims (default 60)",
    )
    parser.add_argument(
        "--log-level", type=str.lower, choices=LEVELS, default="info", help="default info"
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="json (one object per line) or text (default)",
    )
    parser.add_argument(
        "--owner-deployment",
        metavar="NAME",
        help="this controller's Deployment in --namespace: it owns the Lease and the webhook "
        "Secret, so they are deleted with it",
    )
    parser.add_argument(
        "--no-webhook",
        dest="webhook",
        action="store_false",
        help="do not serve the admission webhook from this process",
    )
    add_webhook_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ControllerConfig:
    return ControllerConfig(
        identity=args.identity or _default_identity(),
        lease_name=args.lease_name,
        lease_namespace=args.lease_namespace or args.namespace,
        pending_delay_s=args.pending_delay,
        recheck_s=args.recheck_interval,
        reemit_s=args.reemit_interval,
        binding_grace_s=args.binding_grace,
        clearing_share=args.clearing_share,
        clearing_max_s=args.clearing_max,
        clearing_evict_after_s=args.clearing_evict_after,
        clearing_evict_max_in_flight=args.clearing_evict_max_in_flight,
        node_steering_share=args.node_steering_share,
        node_steering_max_held_share=args.node_steering_max_held_share,
        node_steering_max_s=args.node_steering_max,
        node_steering_nodes=args.node_steering_nodes,
        node_steering_evict_after_s=args.node_steering_evict_after,
        node_steering_evict_max_in_flight=args.node_steering_evict_max_in_flight,
        metrics_port=args.metrics_port or None,
        metrics_address=args.metrics_address,
        plugin_metrics=tuple(args.plugin_metrics),
        idle_window_s=args.idle_window,
        idle_check_s=args.idle_check_interval,
    )


def build_registry(
    controller: Controller, webhook: WebhookOptions | None = None
) -> kopf.OperatorRegistry:
    """kopf's registry: login, start/stop of the controller and, with ``webhook`` options, the
    admission webhook server (every replica serves it; only the lease holder does active work)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(controller.api.configuration)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        # kopf's own Events describe its handlers; there are none that touch objects here.
        settings.posting.enabled = False
        if webhook is not None:
            configure_webhook(settings, webhook, kube.clone(controller.api))
        controller.start()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await asyncio.to_thread(controller.stop)

    return registry


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for evict, after, bound, most in (
        ("--clearing-evict-after", args.clearing_evict_after, "--clearing-max", args.clearing_max),
        (
            "--node-steering-evict-after",
            args.node_steering_evict_after,
            "--node-steering-max",
            args.node_steering_max,
        ),
    ):
        if after is not None and after >= most:
            # Steering would end before eviction is ever considered.
            parser.error(
                f"{evict} {human_duration(after)}: must be less than {bound} "
                f"({human_duration(most)})"
            )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        api = kube.api_client(args.kubeconfig)
    except kube.KubeConfigError as err:
        print(f"flexgpu-controller: {err}", file=sys.stderr)
        return 2
    owner = None
    if args.owner_deployment:
        owner = deployment_owner(api, args.namespace, args.owner_deployment)
    controller = Controller(api, dataclasses.replace(config_from_args(args), owner=owner))
    webhook = options_from_args(args) if args.webhook else None
    if webhook is not None:
        webhook.owner = owner
    registry = build_registry(controller, webhook)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        registry=registry,
        standalone=True,  # one active replica is our Lease's job, not kopf's peering
        clusterwide=True,
        liveness_endpoint=liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
