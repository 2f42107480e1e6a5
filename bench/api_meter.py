"""Counts the apiserver requests each benchmarked plugin makes.

Each plugin talks to the apiserver as its own ServiceAccount, and a FlowSchema per
ServiceAccount routes its requests; the apiserver's priority-and-fairness metric
`apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}` then counts exactly that
plugin's requests (watches included), whatever else talks to the same apiserver.
"""

from __future__ import annotations

import re
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tools.cluster.tokens import service_account_kubeconfig

_METRIC = "apiserver_flowcontrol_dispatched_requests_total"
_ALL_REQUESTS = "apiserver_request_total"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def plugin_identity(api: Any, admin_kubeconfig: Path, namespace: str, name: str, out: Path) -> Path:
    """A kubeconfig for ServiceAccount `namespace/name` with cluster-admin rights, and a
    FlowSchema named `name` that matches only that ServiceAccount. Returns the kubeconfig."""
    # The client's stubs want model objects; plain dicts are what it sends either way.
    core: Any = client.CoreV1Api(api)
    rbac: Any = client.RbacAuthorizationV1Api(api)
    flowcontrol: Any = client.FlowcontrolApiserverV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": f"bench-{name}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin",
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        }
    )
    flowcontrol.create_flow_schema(
        {
            "metadata": {"name": name},
            "spec": {
                # Ahead of the built-in schemas for ServiceAccounts (900 and up).
                "matchingPrecedence": 500,
                "priorityLevelConfiguration": {"name": "workload-high"},
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [
                            {
                                "kind": "ServiceAccount",
                                "serviceAccount": {"name": name, "namespace": namespace},
                            }
                        ],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "clusterScope": True,
                                "namespaces": ["*"],
                            }
                        ],
                        "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                    }
                ],
            },
        }
    )
    return service_account_kubeconfig(api, admin_kubeconfig, namespace, name, out, seconds=4 * 3600)


class RequestCounter:
    """Reads the apiserver's request counters as cluster admin (whose requests are exempt
    from the plugins' FlowSchemas, so reading does not count against them)."""

    def __init__(self, server: str, admin_kubeconfig: Path) -> None:
        doc = yaml.safe_load(admin_kubeconfig.read_text())
        cluster = doc["clusters"][0]["cluster"]
        user = doc["users"][0]["user"]
        self._url = f"{server}/metrics"
        self._ssl = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self._ssl.load_cert_chain(user["client-certificate"], user["client-key"])

    def snapshot(self) -> MetricsSnapshot:
        with urllib.request.urlopen(self._url, timeout=10, context=self._ssl) as resp:
            return parse_metrics(resp.read().decode())


@dataclass(frozen=True)
class MetricsSnapshot:
    by_schema: dict[str, float]  # requests dispatched, by FlowSchema (one per plugin)
    by_kind: dict[str, float]  # all clients' requests, by "verb resource [subresource]"

    def requests_of(self, schema: str, since: MetricsSnapshot) -> float:
        return self.by_schema.get(schema, 0.0) - since.by_schema.get(schema, 0.0)

    def kinds_since(self, since: MetricsSnapshot) -> dict[str, float]:
        delta = {k: v - since.by_kind.get(k, 0.0) for k, v in self.by_kind.items()}
        return {k: v for k, v in delta.items() if v > 0}


def parse_metrics(text: str) -> MetricsSnapshot:
    """The two request counters from the apiserver's Prometheus text exposition."""
    by_schema: dict[str, float] = {}
    by_kind: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in {_METRIC, _ALL_REQUESTS}:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        value = float(match["value"])
        if match["name"] == _METRIC:
            schema = labels.get("flow_schema", "")
            by_schema[schema] = by_schema.get(schema, 0.0) + value
        else:
            parts = (labels.get("verb"), labels.get("resource"), labels.get("subresource"))
            kind = " ".join(p for p in parts if p)
            by_kind[kind] = by_kind.get(kind, 0.0) + value
    return MetricsSnapshot(by_schema, by_kind)
