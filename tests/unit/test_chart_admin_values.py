"""Chart values an admin reaches for on a shared cluster: NetworkPolicies around the daemons'
ports, the webhooks' failure policies, a webhook certificate of one's own, and tolerations for
the taints GPU node pools carry."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from tests.unit.test_chart import CHART, find, helm, render

__all__ = ["helm"]  # the fixture, shared with test_chart.py

MONITORING = (
    "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name"
    "=monitoring"
)
MONITORING_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
}
CONTROLLER_PEER = {
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/instance": "t",
            "app.kubernetes.io/component": "controller",
        }
    }
}


def _policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}


def _ports(rule: dict[str, Any]) -> list[int]:
    return [p["port"] for p in rule["ports"]]


def test_network_policies_are_off_by_default(helm: Path) -> None:
    """Nothing is isolated unless the admin asks: a NetworkPolicy selecting a pod refuses
    whatever it does not name, which a cluster without policies does not expect."""
    assert not _policies(render(helm))


def test_network_policies_admit_only_the_named_peers_on_the_daemons_ports(helm: Path) -> None:
    """On, the plugin accepts its metrics and health ports from the admin's peers and its
    metrics port from the controller (idle-claim Events); the controller its metrics port from
    those peers and its webhook port from anywhere (the API server's address is seldom a
    pod's); nothing else, and only ingress is restricted."""
    docs = render(helm, "networkPolicy.enabled=true", MONITORING)
    policies = _policies(docs)
    plugin, controller = policies["t-flexgpu-kubelet-plugin"], policies["t-flexgpu-controller"]
    assert plugin["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "kubelet-plugin"
    assert controller["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "controller"
    assert plugin["policyTypes"] == controller["policyTypes"] == ["Ingress"]
    assert [(r["from"], _ports(r)) for r in plugin["ingress"]] == [
        ([MONITORING_PEER], [8082, 8083]),
        ([CONTROLLER_PEER], [8082]),
    ]
    assert [(r.get("from"), _ports(r)) for r in controller["ingress"]] == [
        ([MONITORING_PEER], [8080]),
        (None, [8443]),
    ]
    # The selectors match the pods the chart runs.
    daemonset = find(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    deployment = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert plugin["podSelector"]["matchLabels"].items() <= daemonset.items()
    assert controller["podSelector"]["matchLabels"].items() <= deployment.items()


def test_network_policies_without_named_peers_never_open_a_port_to_everyone(helm: Path) -> None:
    """An empty list of peers must not become a rule without ``from`` (which admits every
    source): the plugin then takes only the controller, or nobody; the webhook port is open
    only to the peers named for it, once named."""
    docs = render(
        helm,
        "networkPolicy.enabled=true",
        "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/24",
    )
    policies = _policies(docs)
    assert [(r["from"], _ports(r)) for r in policies["t-flexgpu-kubelet-plugin"]["ingress"]] == [
        ([CONTROLLER_PEER], [8082])
    ]
    assert policies["t-flexgpu-controller"]["ingress"] == [
        {
            "from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
            "ports": [{"port": 8443, "protocol": "TCP"}],
        }
    ]
    closed = _policies(
        render(helm, "networkPolicy.enabled=true", "metrics.idleClaims.enabled=false")
    )
    assert closed["t-flexgpu-kubelet-plugin"]["ingress"] == []


def test_webhook_failure_policies_follow_the_values(helm: Path) -> None:
    """Defaults are the controller's own (GpuNodePolicy Fail, claims and tenancy Ignore, as
    test_chart.py checks); each value changes exactly its webhooks, and the result is what the
    controller would build with the same policies."""
    from flexgpu.controller.tenant_webhook_config import build_tenant_webhook_configuration
    from flexgpu.controller.webhook_config import ServiceRef, build_webhook_configuration

    docs = render(
        helm,
        "webhook.failurePolicy.gpuNodePolicies=Ignore",
        "webhook.failurePolicy.claims=Fail",
        "webhook.failurePolicy.tenancy=Fail",
    )
    target = ServiceRef("flexgpu-system", "t-flexgpu-controller", 443)
    validating = build_webhook_configuration(
        target, None, name="unused", claim_failure_policy="Fail", policy_failure_policy="Ignore"
    )
    mutating = build_tenant_webhook_configuration(
        target, None, name="unused", failure_policy="Fail"
    )
    assert find(docs, "ValidatingWebhookConfiguration")["webhooks"] == validating["webhooks"]
    assert find(docs, "MutatingWebhookConfiguration", "tenancy")["webhooks"] == mutating["webhooks"]


def test_bad_failure_policy_is_refused(helm: Path) -> None:
    result = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--set", "webhook.failurePolicy.claims=No"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "/webhook/failurePolicy/claims" in result.stderr


def test_own_webhook_secret_is_mounted_and_the_controller_gets_no_secret_rights(helm: Path) -> None:
    """With ``webhook.tls.secretName`` the controller serves the admin's certificate from the
    mounted Secret (re-read on change, ``ca.crt`` into the caBundle), makes no Secret of its
    own and may neither read, create nor update any."""
    docs = render(helm, "webhook.tls.secretName=corp-webhook-tls")
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--webhook-cert-dir=/etc/flexgpu/webhook-tls" in args
    assert not any(a.startswith("--webhook-secret-") for a in args)
    assert {"name": "webhook-tls", "secret": {"secretName": "corp-webhook-tls"}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "webhook-tls", "mountPath": "/etc/flexgpu/webhook-tls", "readOnly": True} in (
        mounts
    )
    role = find(docs, "Role", "t-flexgpu-controller")
    assert not [r for r in role["rules"] if "secrets" in r["resources"]]
    policy = find(docs, "ValidatingAdmissionPolicy", "controller-own-secret-and-lease")
    assert "webhook-tls" not in policy["spec"]["variables"][0]["expression"]
    assert not [d for d in docs if d["kind"] in ("Certificate", "Issuer")]


def test_own_webhook_secret_and_cert_manager_together_are_refused(helm: Path) -> None:
    result = subprocess.run(
        [
            str(helm),
            "template",
            "t",
            str(CHART),
            "--api-versions",
            "cert-manager.io/v1",
            "--set",
            "webhook.tls.secretName=corp-webhook-tls",
            "--set",
            "webhook.certManager.enabled=true",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "webhook.tls.secretName and webhook.certManager.enabled" in result.stderr


def test_plugin_tolerates_the_taints_of_gpu_node_pools(helm: Path) -> None:
    """NVIDIA's and flexgpu's own keys, and AKS's ``sku=gpu`` of GPU node pools."""
    tolerations = find(render(helm), "DaemonSet")["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in (
        tolerations
    )
    assert {t["key"] for t in tolerations} >= {"nvidia.com/gpu", "flexgpu.dev/gpu", "sku"}
