"""The ``flexgpu explain`` command: its arguments, one target or every waiting pod, and the
printed or JSON/YAML report. What is found for each claim is ``controller.cli_explain``'s."""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import asdict
from functools import partial
from typing import Any

from kubernetes import client

from flexgpu.controller.cli_cluster import read_cluster
from flexgpu.controller.cli_explain import (
    WIDTH,
    explain_claim,
    explain_pod,
    parse_target,
    read_or_none,
)
from flexgpu.controller.cli_options import (
    CliError,
    Connection,
    ExitCode,
    add_cluster_options,
    call,
    connect,
    emit,
)
from flexgpu.controller.extended_resources import extended_resources


def _fill(text: str, width: int = WIDTH - 2) -> str:
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def _print(text: str) -> None:
    print(_fill(text, WIDTH))


def _waiting_pods(connection: Connection, namespace: str | None) -> list[dict[str, Any]]:
    """Pods with ResourceClaims or extended resources that are not running yet (nor being
    deleted)."""
    core = client.CoreV1Api(connection.api)
    if namespace is None:
        listed = call(connection, "list pods", core.list_pod_for_all_namespaces)
    else:
        what = f"list pods in namespace {namespace}"
        listed = call(connection, what, partial(core.list_namespaced_pod, namespace))
    return [
        p
        for p in listed.get("items") or []
        if ((p.get("spec") or {}).get("resourceClaims") or extended_resources(p.get("spec") or {}))
        and (p.get("status") or {}).get("phase", "Pending") == "Pending"
        and not (p.get("metadata") or {}).get("deletionTimestamp")
    ]


def _explain_waiting(connection: Connection, output: str | None) -> int:
    """No target: every waiting pod with claims in the namespace, or in all with -A."""
    namespace = None if connection.all_namespaces else connection.namespace
    pods = _waiting_pods(connection, namespace)
    read = read_cluster(connection, namespace=namespace)
    reports = []
    for raw in sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"])):
        meta = raw["metadata"]
        try:
            findings = explain_pod(connection, read, raw)
        except CliError as err:
            if err.code != ExitCode.NOT_FOUND:
                raise
            continue  # extended resources none of flexgpu's classes serve
        reports.append((meta["namespace"], meta["name"], findings))
    blocked = any(f.blocked for _, _, findings in reports for f in findings)
    if output:
        body = [
            {
                "kind": "Pod",
                "namespace": ns,
                "name": name,
                "satisfied": not any(f.blocked for f in findings),
                "claims": [asdict(f) for f in findings],
            }
            for ns, name, findings in reports
        ]
        emit({"pods": body, "notes": read.notes}, output)
    elif not reports:
        where = "any namespace" if namespace is None else f"namespace {namespace}"
        print(f"No pod with ResourceClaims is waiting in {where}.")
    else:
        for i, (ns, name, findings) in enumerate(reports):
            if i:
                print()
            print(f"pod {ns}/{name}:")
            for finding in findings:
                print(textwrap.indent(_fill(finding.message), "  "))
        for note in read.notes:
            print()
            _print(f"Note: {note}")
    return ExitCode.UNSATISFIED if blocked else ExitCode.OK


def run_explain(args: argparse.Namespace) -> int:
    connection = connect(args)
    if args.target is None:
        return _explain_waiting(connection, args.output)
    if connection.all_namespaces:
        raise CliError("-A explains every waiting pod: give no NAME with it", ExitCode.USAGE)
    target = parse_target(args.target, connection.namespace)
    ns = target.namespace
    core, resource = client.CoreV1Api(connection.api), client.ResourceV1Api(connection.api)
    raw_claim = None
    if target.kind in ("", "claim"):
        raw_claim = read_or_none(
            connection,
            f"read ResourceClaim {target.name} in namespace {ns}",
            resource.read_namespaced_resource_claim,
            target.name,
            ns,
        )
    raw_pod = None
    if raw_claim is None and target.kind in ("", "pod"):
        raw_pod = read_or_none(
            connection,
            f"read pod {target.name} in namespace {ns}",
            core.read_namespaced_pod,
            target.name,
            ns,
        )
    if raw_claim is None and raw_pod is None:
        what = {"pod": "pod", "claim": "ResourceClaim"}.get(target.kind, "ResourceClaim or pod")
        raise CliError(f"no {what} {target.name} in namespace {ns}", ExitCode.NOT_FOUND)
    read = read_cluster(connection, namespace=ns, pods=raw_claim is not None)
    if raw_claim is not None:
        claim = read.snapshot.claims.get(f"{ns}/{target.name}")
        if claim is None:  # deleted between the two reads
            raise CliError(f"no ResourceClaim {target.name} in namespace {ns}", ExitCode.NOT_FOUND)
        kind, findings = "ResourceClaim", explain_claim(read, claim)
    else:
        assert raw_pod is not None
        kind, findings = "Pod", explain_pod(connection, read, raw_pod)
    blocked = any(f.blocked for f in findings)
    if args.output:
        emit(
            {
                "kind": kind,
                "namespace": ns,
                "name": target.name,
                "satisfied": not blocked,
                "claims": [asdict(f) for f in findings],
                "notes": read.notes,
            },
            args.output,
        )
    else:
        for i, finding in enumerate(findings):
            if i:
                print()
            _print(finding.message)
        for note in read.notes:
            print()
            _print(f"Note: {note}")
    return ExitCode.UNSATISFIED if blocked else ExitCode.OK


def add_explain(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="why a pod's claims (or a claim) are not satisfied, or where they are",
        description="Explains a pod's ResourceClaims, or one ResourceClaim: where they are "
        "allocated and whether the node prepared them, or why they cannot be allocated (the "
        "controller's own check), or why they do not exist. Exit status: 0 satisfied or on "
        "its way, 3 a claim is blocked, 4 no such object, 1 the cluster could not be read.",
    )
    parser.add_argument(
        "target",
        nargs="?",
        metavar="[pod/|resourceclaim/]NAME",
        help="a pod or ResourceClaim (without a kind: a claim of that name, else a pod); "
        "NAMESPACE/NAME is read as the namespace and name; none: every pod with claims that "
        "waits in the namespace (with -A: in every namespace)",
    )
    add_cluster_options(parser, outputs=("json", "yaml"))
    parser.set_defaults(handler=run_explain)
