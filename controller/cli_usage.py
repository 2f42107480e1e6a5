"""``flexgpu usage``: GPU-hours allocated and used per namespace (per claim with ``-o wide``),
by device class, product, MIG profile and share, and the claims that sit idle.

Two sources, one report:

- ``--prometheus URL``: PromQL over ``--range`` (default 24h): ``increase()`` of the plugins'
  ``flexgpu_claim_allocated_gpu_seconds_total`` and ``..._used_...``, and the claims whose
  ``flexgpu_claim_idle_seconds`` has reached ``--idle-window``;
- otherwise the plugins' own endpoints: ``--plugin HOST:PORT`` (repeatable), or every pod of
  the kubelet plugin found through the API server (its ``metrics`` port, read through the pod
  proxy). Their counters run from when each claim was prepared, or its plugin last started.

Namespaces as kubectl has them: ``-n`` one, ``-A`` every one, by default the kubeconfig
context's (else ``default``); ``--kubeconfig`` and ``--context`` also choose the cluster when
the plugin pods are found through the API server. Errors are one line, exit status as in
``cli_options.ExitCode``; idle time reads ``3h20m`` in tables and stays in seconds in JSON/YAML.

A GPU-hour is one whole GPU for an hour: a MIG instance counts for its share of the GPU's
multiprocessors, a share of a shared GPU for its compute share; "used" is SM utilisation
times that.
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexgpu.controller.cli_options import (
    REQUEST_TIMEOUT_S,
    CliError,
    ExitCode,
    add_cluster_options,
    call,
    connect,
    emit,
    namespace_of,
)
from flexgpu.controller.plugin_endpoints import Sample, Scrape, parse, scrape
from flexgpu.driver.durations import human_duration, parse_duration

ALLOCATED = "flexgpu_claim_allocated_gpu_seconds_total"
USED = "flexgpu_claim_used_gpu_seconds_total"
IDLE = "flexgpu_claim_idle_seconds"
GROUP = ("namespace", "claim", "class", "product", "profile", "share")
PLUGIN_SELECTOR = "app.kubernetes.io/component=kubelet-plugin"


class UsageError(RuntimeError):
    """The source cannot be read; the text says which and why."""


@dataclass(frozen=True)
class UsageRow:
    namespace: str
    device_class: str
    product: str
    profile: str
    claim: str = ""  # empty in per-namespace rows
    share: str = ""
    allocated_gpu_hours: float = 0.0
    used_gpu_hours: float = 0.0

    @property
    def used_percent(self) -> float | None:
        if self.allocated_gpu_hours <= 0:
            return None
        return 100 * self.used_gpu_hours / self.allocated_gpu_hours


@dataclass(frozen=True)
class IdleClaim:
    namespace: str
    claim: str
    idle_seconds: float
    nodes: tuple[str, ...]


@dataclass
class UsageReport:
    source: str  # "prometheus" or "plugins"
    range: str | None
    rows: list[UsageRow] = field(default_factory=list)  # per claim device group
    idle: list[IdleClaim] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)


def _key(labels: dict[str, str]) -> tuple[str, ...]:
    return tuple(labels.get(name, "") for name in GROUP)


def claim_rows(allocated: Iterable[Sample], used: Iterable[Sample]) -> list[UsageRow]:
    """Per (namespace, claim, class, product, profile, share): GPU-hours from GPU-seconds."""
    seconds: dict[tuple[str, ...], list[float]] = {}
    for index, samples in ((0, allocated), (1, used)):
        for s in samples:
            seconds.setdefault(_key(s.labels), [0.0, 0.0])[index] += s.value
    rows = []
    for key, (alloc, use) in sorted(seconds.items()):
        namespace, claim, klass, product, profile, share = key
        rows.append(
            UsageRow(namespace, klass, product, profile, claim, share, alloc / 3600, use / 3600)
        )
    return rows


def idle_claims(samples: Iterable[Sample], window_s: float) -> list[IdleClaim]:
    """Claims idle at least ``window_s`` on every node that reports them."""
    found: dict[tuple[str, str], tuple[float, set[str]]] = {}
    for s in samples:
        key = (s.labels.get("namespace", ""), s.labels.get("claim", ""))
        seconds, nodes = found.get(key, (float("inf"), set()))
        found[key] = (min(seconds, s.value), nodes | {s.labels.get("node", "")})
    return [
        IdleClaim(ns, claim, seconds, tuple(sorted(n for n in nodes if n)))
        for (ns, claim), (seconds, nodes) in sorted(found.items())
        if seconds >= window_s
    ]


def by_namespace(rows: Iterable[UsageRow]) -> list[UsageRow]:
    totals: dict[tuple[str, str, str, str], list[float]] = {}
    for r in rows:
        sums = totals.setdefault((r.namespace, r.device_class, r.product, r.profile), [0.0, 0.0])
        sums[0] += r.allocated_gpu_hours
        sums[1] += r.used_gpu_hours
    return [
        UsageRow(ns, klass, product, profile, allocated_gpu_hours=a, used_gpu_hours=u)
        for (ns, klass, product, profile), (a, u) in sorted(totals.items())
    ]


# -- sources ----------------------------------------------------------------------------------


def _promql(base: str, query: str) -> list[Sample]:
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            body = json.loads(response.read())
    except (OSError, ValueError) as err:
        raise UsageError(f"Prometheus at {base} did not answer {query!r}: {err}") from None
    if body.get("status") != "success":
        raise UsageError(f"Prometheus at {base} refused {query!r}: {body.get('error', body)}")
    return [
        Sample("", dict(item["metric"]), float(item["value"][1])) for item in body["data"]["result"]
    ]


def from_prometheus(base: str, range_text: str, window_s: float) -> UsageReport:
    by = ", ".join(GROUP)
    allocated = _promql(base, f"sum by ({by}) (increase({ALLOCATED}[{range_text}]))")
    used = _promql(base, f"sum by ({by}) (increase({USED}[{range_text}]))")
    # Per node and plugin pod, as the plugins report it; idle_claims combines them.
    idle = _promql(base, f"max by (namespace, claim, node) ({IDLE})")
    return UsageReport(
        "prometheus", range_text, claim_rows(allocated, used), idle_claims(idle, window_s)
    )


def _plugin_pods_scrape(args: argparse.Namespace) -> Scrape:
    """Every kubelet plugin pod's /metrics, read through the API server's pod proxy."""
    from kubernetes import client

    connection = connect(args)
    core = client.CoreV1Api(connection.api)
    what = "list the kubelet plugin pods"
    if args.plugin_namespace:
        listed = call(
            connection,
            what,
            core.list_namespaced_pod,
            args.plugin_namespace,
            label_selector=PLUGIN_SELECTOR,
        )
    else:
        listed = call(
            connection, what, core.list_pod_for_all_namespaces, label_selector=PLUGIN_SELECTOR
        )
    pods: list[dict[str, Any]] = listed.get("items") or []
    result = Scrape()
    for pod in pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        name, pod_namespace = str(meta.get("name", "")), str(meta.get("namespace", ""))
        port = next(
            (
                p.get("containerPort")
                for c in spec.get("containers") or []
                for p in c.get("ports") or []
                if p.get("name") == "metrics"
            ),
            None,
        )
        where = f"{pod_namespace}/{name}"
        if port is None or (pod.get("status") or {}).get("phase") != "Running":
            result.failures.append(f"{where}: no running metrics port")
            continue
        try:
            text = core.connect_get_namespaced_pod_proxy_with_path(
                f"{name}:{port}", pod_namespace, "metrics", _request_timeout=REQUEST_TIMEOUT_S
            )
            result.samples.extend(parse(str(text)))
        except Exception as err:
            result.failures.append(f"{where}: {err}")
    return result


def from_plugins(found: Scrape, window_s: float) -> UsageReport:
    rows = claim_rows(found.named(ALLOCATED), found.named(USED))
    idle = idle_claims(found.named(IDLE), window_s)
    return UsageReport("plugins", None, rows, idle, list(found.failures))


# -- output -----------------------------------------------------------------------------------


def _hours(value: float) -> str:
    return f"{value:.2f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=False)]
    lines = [
        "  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
        for line in (headers, *rows)
    ]
    return "\n".join(lines)


def render_table(report: UsageReport, wide: bool) -> str:
    rows = report.rows if wide else by_namespace(report.rows)
    headers = ["NAMESPACE"] + (["CLAIM"] if wide else []) + ["CLASS", "PRODUCT", "PROFILE"]
    headers += (["SHARE"] if wide else []) + ["ALLOCATED GPU-H", "USED GPU-H", "USED %"]
    body = []
    for r in rows:
        line = [r.namespace] + ([r.claim] if wide else []) + [r.device_class, r.product]
        line += [r.profile or "-"] + ([r.share or "-"] if wide else [])
        used = r.used_percent
        line += [
            _hours(r.allocated_gpu_hours),
            _hours(r.used_gpu_hours),
            "-" if used is None else f"{used:.0f}",
        ]
        body.append(line)
    span = f"last {report.range}" if report.range else "since each claim was prepared"
    parts = [
        f"GPU usage ({span}, from {report.source})",
        _table(headers, body) if body else "no GPU claims",
    ]
    if report.idle:
        idle = [
            [i.namespace, i.claim, human_duration(i.idle_seconds), ",".join(i.nodes) or "-"]
            for i in report.idle
        ]
        parts += ["", "Idle claims:", _table(["NAMESPACE", "CLAIM", "IDLE FOR", "NODES"], idle)]
    if report.unreachable:
        parts += ["", "Not read: " + "; ".join(report.unreachable)]
    return "\n".join(parts)


def report_document(report: UsageReport, wide: bool) -> dict[str, Any]:
    def row(r: UsageRow) -> dict[str, Any]:
        body: dict[str, Any] = {
            "namespace": r.namespace,
            "deviceClass": r.device_class,
            "product": r.product,
            "profile": r.profile,
            "allocatedGpuHours": round(r.allocated_gpu_hours, 6),
            "usedGpuHours": round(r.used_gpu_hours, 6),
        }
        if wide:
            body |= {"claim": r.claim, "share": r.share}
        return body

    return {
        "source": report.source,
        "range": report.range,
        "namespaces": [row(r) for r in by_namespace(report.rows)],
        **({"claims": [row(r) for r in report.rows]} if wide else {}),
        "idleClaims": [
            {
                "namespace": i.namespace,
                "claim": i.claim,
                "idleSeconds": i.idle_seconds,
                "nodes": list(i.nodes),
            }
            for i in report.idle
        ],
        "unreachable": report.unreachable,
    }


def run_usage(args: argparse.Namespace) -> int:
    # Endpoints that do not answer are listed in the report itself.
    logging.getLogger("flexgpu.controller.plugin_endpoints").setLevel(logging.ERROR)
    try:
        window_s = parse_duration(args.idle_window)
        if args.prometheus:
            parse_duration(args.range)
    except ValueError as err:
        raise CliError(f"usage: {err}", ExitCode.USAGE) from None
    try:
        if args.prometheus:
            report = from_prometheus(args.prometheus, args.range, window_s)
        elif args.plugin:
            report = from_plugins(scrape(args.plugin), window_s)
        else:
            report = from_plugins(_plugin_pods_scrape(args), window_s)
    except (UsageError, ValueError) as err:
        raise CliError(" ".join(str(err).split())) from None
    namespace = namespace_of(args)
    if namespace is not None:
        report.rows = [r for r in report.rows if r.namespace == namespace]
        report.idle = [i for i in report.idle if i.namespace == namespace]
    if args.output in ("json", "yaml"):
        emit(report_document(report, True), args.output)
    else:
        print(render_table(report, args.output == "wide"))
    # Nothing read from anywhere: say so in the exit status too.
    return ExitCode.FAILED if report.unreachable and not report.rows else ExitCode.OK


def add_usage(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "usage",
        help="GPU-hours allocated and used per namespace and claim, and idle claims",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    source = parser.add_argument_group("source")
    source.add_argument("--prometheus", metavar="URL", help="read from this Prometheus")
    source.add_argument(
        "--range", default="24h", help="with --prometheus: the period (default 24h)"
    )
    source.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="read this kubelet plugin's metrics endpoint (repeatable); default: every plugin "
        "pod, through the API server",
    )
    source.add_argument("--plugin-namespace", help="namespace of the plugin pods (default: all)")
    parser.add_argument(
        "--idle-window",
        default="2h",
        help="a claim idle this long is listed as idle (default 2h, the chart's default)",
    )
    # -o: a table per namespace by default, wide per claim, json/yaml with both.
    add_cluster_options(parser, outputs=("json", "yaml", "wide"))
    parser.set_defaults(handler=run_usage)
