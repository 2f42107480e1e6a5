"""``flexgpu explain`` and ``flexgpu capacity``: the controller's evaluation, from a workstation.

Both read the cluster once (slices, classes, claims, nodes, and the pods of the namespace in
question) into the same ``ClusterState`` the controller keeps, and run the same code on it, so
what the CLI prints is what the controller's Events say.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from fractions import Fraction
from functools import partial
from typing import Any, TypeAlias

from kubernetes import client

from controller import kube
from controller.cluster_state import ClusterState, Kind, Snapshot
from controller.evaluation import Evaluation, evaluate
from controller.messages import Lookup, claim_message, pod_message
from controller.records import ClaimRecord, PodRecord
from controller.reflector import list_function
from driver.allocation import CapacityRow, capacity_summary
from driver.allocation.describe import format_quantity

# argparse's class is not subscriptable at run time: the alias is a string.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
WIDTH = 100


def _fail(message: str) -> int:
    print(f"flexgpu: {message}", file=sys.stderr)
    return 1


def load_state(api: client.ApiClient, pods_namespace: str | None) -> ClusterState:
    """Lists what an explanation needs; pods only from ``pods_namespace`` (all pods of a large
    cluster are many, and only the pod in question matters)."""
    state = ClusterState()
    kinds: tuple[Kind, ...] = ("slices", "classes", "claims", "nodes")
    for kind in kinds:
        state.replace(kind, kube.raw(list_function(kind, api))["items"])
    if pods_namespace is not None:
        pods = partial(client.CoreV1Api(api).list_namespaced_pod, pods_namespace)
        state.replace("pods", kube.raw(pods)["items"])
    return state


def _allocated_text(claim: ClaimRecord) -> str:
    devices = ", ".join(f"{r.pool}/{r.device}" for r in claim.model.allocation or ())
    where = f" on {', '.join(claim.allocation_nodes)}" if claim.allocation_nodes else ""
    users = f", reserved for {', '.join(claim.reserved_for)}" if claim.reserved_for else ""
    return f"Claim {claim.model.key} is allocated{where}: {devices or 'no devices'}{users}."


def _waiting_pod(snapshot: Snapshot, claim: ClaimRecord) -> PodRecord | None:
    for pod in sorted(snapshot.pods.values(), key=lambda p: p.name):
        if not pod.node_name and claim.model.key in pod.claim_keys():
            return pod
    return None


def _print(text: str) -> None:
    print(textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False))


def _report(ev: Evaluation, lookup: Lookup, *, for_pod: bool) -> None:
    if ev.satisfiable:
        nodes = ", ".join(ev.explanation.allocatable_nodes)
        who = f" for pod {ev.pod.key}" if ev.pod is not None else ""
        _print(
            f"Claim {ev.claim.model.key} can be allocated{who} on {nodes}; if a pod still "
            "waits, the reason is not its GPUs (see kubectl describe pod)."
        )
        return
    _print(pod_message(ev, lookup) if for_pod else claim_message(ev, lookup))


def run_explain(args: argparse.Namespace) -> int:
    namespace, _, name = args.target.partition("/")
    if not namespace or not name:
        return _fail("give the claim or pod as NAMESPACE/NAME")
    try:
        api = kube.api_client(args.kubeconfig, in_cluster_first=False)
        snapshot = load_state(api, namespace).snapshot()
    except (kube.KubeConfigError, client.ApiException, OSError) as err:
        return _fail(f"cannot read the cluster: {err}")
    lookup = Lookup(snapshot)
    key = f"{namespace}/{name}"
    claim = snapshot.claims.get(key)
    if claim is not None:
        if claim.allocated:
            _print(_allocated_text(claim))
            return 0
        pod = _waiting_pod(snapshot, claim)
        _report(evaluate(snapshot, claim, pod), lookup, for_pod=False)
        return 0
    pod = snapshot.pods.get(key)
    if pod is None:
        return _fail(f"no ResourceClaim or pod {key}")
    if not pod.claims:
        return _fail(f"pod {key} uses no ResourceClaim")
    for i, ref in enumerate(pod.claims):
        if i:
            print()
        record = snapshot.claims.get(f"{namespace}/{ref.claim}") if ref.claim else None
        if record is None:
            _print(f"Claim {ref.name} of pod {key} does not exist yet.")
        elif record.allocated:
            _print(_allocated_text(record))
        else:
            _report(evaluate(snapshot, record, pod), lookup, for_pod=True)
    return 0


# --- capacity ---------------------------------------------------------------------------------


def _shareable_json(row: CapacityRow) -> dict[str, Any]:
    return {
        name: {"free": format_quantity(left), "total": format_quantity(total)}
        for name, (left, total) in sorted(row.shareable.items())
    }


def _share_text(row: CapacityRow) -> str:
    def one(name: str, left: Fraction, total: Fraction) -> str:
        unit = "%" if name == "compute" else ""
        return f"{name} {format_quantity(left)}{unit}/{format_quantity(total)}{unit}"

    return ", ".join(one(n, *v) for n, v in sorted(row.shareable.items())) or "-"


def capacity_table(rows: list[CapacityRow]) -> str:
    header = ("TYPE", "PRODUCT", "PROFILE", "FREE", "TOTAL", "SHAREABLE FREE/TOTAL")
    lines = [header] + [
        (r.type, r.product or "-", r.profile or "-", str(r.free), str(r.total), _share_text(r))
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths, strict=True))
        + "  "
        + line[-1]
        for line in lines
    )


def run_capacity(args: argparse.Namespace) -> int:
    try:
        api = kube.api_client(args.kubeconfig, in_cluster_first=False)
        snapshot = load_state(api, None).snapshot()
    except (kube.KubeConfigError, client.ApiException, OSError) as err:
        return _fail(f"cannot read the cluster: {err}")
    rows = capacity_summary(
        list(snapshot.slices.values()), [c.model for c in snapshot.claims.values()]
    )
    if args.json:
        body = [
            {
                "type": r.type,
                "product": r.product,
                "profile": r.profile,
                "total": r.total,
                "free": r.free,
                "shareable": _shareable_json(r),
            }
            for r in rows
        ]
        print(json.dumps(body, indent=2))
        return 0
    if not rows:
        print("No flexgpu devices are published in this cluster.")
        return 0
    print(capacity_table(rows))
    return 0


# --- registration -----------------------------------------------------------------------------


def _kubeconfig_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)"
    )


def add_explain(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="why a claim (or a pod's claims) cannot be allocated, or where it is",
        description="Runs the controller's allocation check for a ResourceClaim or a pod from "
        "this workstation and prints why it cannot be allocated, or where it is allocated.",
    )
    parser.add_argument("target", metavar="NAMESPACE/NAME", help="a ResourceClaim or a pod")
    _kubeconfig_option(parser)
    parser.set_defaults(handler=run_explain)


def add_capacity(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "capacity",
        help="free and total GPUs, MIG partitions and shareable capacity, cluster-wide",
        description="Free devices per type, product and MIG profile, and the memory and "
        "compute left on shared GPUs, from the published ResourceSlices and allocated claims.",
    )
    _kubeconfig_option(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run_capacity)
