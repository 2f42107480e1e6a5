"""The Helm chart lints, renders with every option, refuses bad values, ships the CRDs the
code generates, and gives each component only what it needs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tools.cluster.binaries import REPO_ROOT, helm_tools_dir

CHART = REPO_ROOT / "charts" / "flexgpu"


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_tools_dir() / "helm"


def render(helm: Path, *values: str, kube_version: str = "") -> list[dict[str, Any]]:
    args = [
        str(helm),
        "template",
        "t",
        str(CHART),
        "--namespace",
        "flexgpu-system",
        "--api-versions",
        "monitoring.coreos.com/v1",
        "--api-versions",
        "cert-manager.io/v1",
    ]
    if kube_version:  # else helm's default, the newest release it knows
        args += ["--kube-version", kube_version]
    for value in values:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict[str, Any]], kind: str, name_part: str = "") -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"])


def test_lint_passes(helm: Path) -> None:
    result = subprocess.run(
        [str(helm), "lint", str(CHART)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_option_renders(helm: Path) -> None:
    docs = render(
        helm,
        "metrics.serviceMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
        "webhook.certManager.enabled=true",
        "deviceClasses.gpuExtendedResourceName=nvidia.com/gpu",
    )
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"} <= kinds
    assert find(docs, "DeviceClass", "gpu.flexgpu.dev")["spec"]["extendedResourceName"] == (
        "nvidia.com/gpu"
    )
    args = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--webhook-cert-dir=/etc/flexgpu/webhook-tls" in args


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("kubeletPlugin.gpuBackend=cuda", "value must be one of 'nvml', 'simulated'"),
        ("kubeletPlugin.sharedGpus=some", "/kubeletPlugin/sharedGpus"),
        ("kubeletPlugin.sharedGpuTenants=all", "/kubeletPlugin/sharedGpuTenants"),
        ("controller.replicas=0", "/controller/replicas"),
        ("kubeletPlugin.healthIntervalSeconds=45", "/kubeletPlugin/healthIntervalSeconds"),
        ("unknown=1", "additional properties 'unknown' not allowed"),
    ],
)
def test_bad_values_fail_with_a_clear_message(helm: Path, value: str, message: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_chart_ships_the_generated_crds() -> None:
    for crd in (REPO_ROOT / "crds").glob("*.yaml"):
        assert (CHART / "crds" / crd.name).read_text() == crd.read_text(), crd.name


def test_device_classes_match_the_demo_catalog(helm: Path) -> None:
    # The catalog is what the test world of every release applies: the chart as on 1.36, before
    # its default names nvidia.com/gpu (test_whole_gpu_class_serves_nvidia_gpu_by_default_...).
    rendered = {
        d["metadata"]["name"]: d["spec"]
        for d in render(helm, kube_version="1.36.1")
        if d["kind"] == "DeviceClass"
    }
    demo = {
        d["metadata"]["name"]: d["spec"]
        for d in yaml.safe_load_all((REPO_ROOT / "demo" / "deviceclasses.yaml").read_text())
        if d
    }
    assert rendered == demo


def test_plugin_is_least_privilege_and_rolls_without_a_gap(helm: Path) -> None:
    docs = render(helm)
    role = find(docs, "ClusterRole", "kubelet-plugin")
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert "secrets" not in resources and "pods" not in resources
    # Pods only in the release namespace, for MPS daemons (the admission policy limits them).
    mps = find(docs, "Role", "kubelet-plugin-mps-pods")
    assert mps["metadata"]["namespace"] == "flexgpu-system"
    assert mps["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["pods"],
            "verbs": ["create", "get", "list", "watch", "delete"],
        }
    ]
    writes = {
        r
        for rule in role["rules"]
        for r in rule["resources"]
        if set(rule["verbs"]) & {"create", "update", "patch", "delete"}
    }
    # Its node's slices, its claims' status.devices (patch or replace) and its own entry of a
    # GpuNodePolicy's status.nodes (admission policies narrow each to its node).
    assert writes == {"resourceslices", "resourceclaims/status", "gpunodepolicies/status"}
    # Events: only in namespace default (where Events about Nodes go), and the admission
    # policy limits them to the plugin's own Node.
    events = find(docs, "Role", "kubelet-plugin-node-events")
    assert events["metadata"]["namespace"] == "default"
    assert events["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    strategy = find(docs, "DaemonSet")["spec"]["updateStrategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 1, "maxUnavailable": 0}
    env = find(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "FLEXGPU_POD_UID",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}},
    } in env
    # Its pod name: its DaemonSet then owns the MPS daemon pods (helm uninstall removes them).
    assert {
        "name": "FLEXGPU_POD_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    } in env
    assert {"name": "FLEXGPU_SHARED_GPU_TENANTS", "value": "namespace"} in env
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    for suffix in ("own-node-slices", "own-node-policy-status", "own-node-events", "mps-pods"):
        policy = policies[f"t-flexgpu-kubelet-plugin-{suffix}"]
        assert "t-flexgpu-kubelet-plugin" in policy["spec"]["matchConditions"][0]["expression"]
        bindings = [
            d
            for d in docs
            if d["kind"] == "ValidatingAdmissionPolicyBinding"
            and d["spec"]["policyName"] == policy["metadata"]["name"]
        ]
        assert [b["spec"]["validationActions"] for b in bindings] == [["Deny"]]


def test_controller_writes_only_its_own_webhook_configuration(helm: Path) -> None:
    docs = render(helm)
    role = find(docs, "ClusterRole", "controller")
    rules = [r for r in role["rules"] if "validatingwebhookconfigurations" in r["resources"]]
    # The chart installs the configuration; the controller may only update that one (its
    # caBundle), and create nothing.
    assert [r.get("resourceNames") for r in rules] == [["t-flexgpu-validation"]]
    assert {v for r in rules for v in r["verbs"]} == {"get", "update", "patch"}
    policy = find(docs, "ValidatingAdmissionPolicy", "controller-own-webhook-configuration")
    assert "t-flexgpu-validation" in policy["spec"]["validations"][0]["expression"]
    args = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--webhook-configuration-name=t-flexgpu-validation" in args
    assert "--webhook-ca-bundle-only" in args
    # Its Deployment owns the Lease and Secret it makes at run time: it may read only that one.
    assert "--owner-deployment=t-flexgpu-controller" in args
    role = find(docs, "Role", "t-flexgpu-controller")
    assert {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "resourceNames": ["t-flexgpu-controller"],
        "verbs": ["get"],
    } in role["rules"]
    # Without the webhook, no configuration and no right to any webhook configuration at all.
    off = render(helm, "webhook.enabled=false")
    assert not [d for d in off if d["kind"] == "ValidatingWebhookConfiguration"]
    role_off = find(off, "ClusterRole", "controller")
    assert not any("validatingwebhookconfigurations" in r["resources"] for r in role_off["rules"])
    assert not any(
        d["kind"] == "ValidatingAdmissionPolicy"
        and "webhook-configuration" in d["metadata"]["name"]
        for d in off
    )


@pytest.mark.parametrize("cert_manager", [False, True])
def test_controller_secrets_and_lease_only_by_name(helm: Path, cert_manager: bool) -> None:
    """Its Secret (the webhook certificate it makes; none with cert-manager) and its Lease,
    by name; creating them is pinned to those names by an admission policy."""
    docs = render(helm, f"webhook.certManager.enabled={str(cert_manager).lower()}")
    role = find(docs, "Role", "t-flexgpu-controller")
    secrets = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    leases = [r for r in role["rules"] if r["resources"] == ["leases"]]
    assert leases == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["t-flexgpu-controller"],
            "verbs": ["get", "update", "patch"],
        },
    ]
    if cert_manager:
        assert secrets == []
    else:
        assert secrets == [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["t-flexgpu-webhook-tls"],
                "verbs": ["get", "update"],
            },
        ]
    args = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--lease-name=t-flexgpu-controller" in args
    policy = find(docs, "ValidatingAdmissionPolicy", "controller-own-secret-and-lease")
    own = policy["spec"]["variables"][0]["expression"]
    assert '"t-flexgpu-controller"' in own
    assert ('"t-flexgpu-webhook-tls"' in own) is not cert_manager


@pytest.mark.parametrize(
    ("kube_version", "values", "policy", "granular"),
    [
        ("1.34.0", [], True, False),
        ("1.35.2", [], True, False),
        ("1.36.0", [], False, True),
        ("1.37.2", [], False, True),
        ("1.37.2", ["kubeletPlugin.claimStatusAdmissionPolicy=always"], True, True),
    ],
)
def test_plugin_claim_status_rights_follow_the_server_release(
    helm: Path, kube_version: str, values: list[str], policy: bool, granular: bool
) -> None:
    """1.36+ checks status.devices writes per driver and node (resourceclaims/driver,
    associated-node); before, an admission policy limits the plugin to its node's entries."""
    docs = render(helm, *values, kube_version=kube_version)
    rules = find(docs, "ClusterRole", "kubelet-plugin")["rules"]
    status = [r for r in rules if r["resources"] == ["resourceclaims/status"]]
    assert [r["verbs"] for r in status] == [["update", "patch"]]
    driver = [r for r in rules if r["resources"] == ["resourceclaims/driver"]]
    assert driver == (
        [
            {
                "apiGroups": ["resource.k8s.io"],
                "resources": ["resourceclaims/driver"],
                "resourceNames": ["gpu.flexgpu.dev"],
                "verbs": ["associated-node:update", "associated-node:patch"],
            }
        ]
        if granular
        else []
    )
    assert not any("arbitrary-node" in v for r in rules for v in r["verbs"])
    assert not any("resourceclaims/binding" in r["resources"] for r in rules)
    policies = [
        d
        for d in docs
        if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
        and d["metadata"]["name"] == "t-flexgpu-kubelet-plugin-own-node-claim-status"
    ]
    assert len(policies) == (2 if policy else 0)


def test_claim_status_policy_value_is_checked(helm: Path) -> None:
    result = subprocess.run(
        [
            str(helm),
            "template",
            "t",
            str(CHART),
            "--set",
            "kubeletPlugin.claimStatusAdmissionPolicy=never",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "/kubeletPlugin/claimStatusAdmissionPolicy" in result.stderr


def test_tenancy_webhook_is_the_controllers_own_and_follows_the_tenancy_value(helm: Path) -> None:
    """With shared GPUs serving one namespace at a time (the default) the chart renders the
    MutatingWebhookConfiguration the controller builds (controller/tenant_webhook_config.py),
    names it to the controller and lets the controller update only that one; with
    ``sharedGpuTenants: any`` or the webhook off there is none and no right to it."""
    from flexgpu.controller.tenant_webhook_config import build_tenant_webhook_configuration
    from flexgpu.controller.webhook_config import ServiceRef

    docs = render(helm)
    rendered = find(docs, "MutatingWebhookConfiguration", "tenancy")
    assert rendered["metadata"]["name"] == "t-flexgpu-tenancy"
    built = build_tenant_webhook_configuration(
        ServiceRef("flexgpu-system", "t-flexgpu-controller", 443), None, name="unused"
    )
    assert rendered["webhooks"] == built["webhooks"]
    args = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tenant-webhook-configuration-name=t-flexgpu-tenancy" in args
    role = find(docs, "ClusterRole", "controller")
    rules = [
        r
        for r in role["rules"]
        if "mutatingwebhookconfigurations" in r["resources"]
        and "t-flexgpu-tenancy" in r.get("resourceNames", [])
    ]
    assert [(r.get("resourceNames"), set(r["verbs"])) for r in rules] == [
        (["t-flexgpu-tenancy"], {"get", "update", "patch"})
    ]
    policy = find(docs, "ValidatingAdmissionPolicy", "controller-own-webhook-configuration")
    assert "t-flexgpu-tenancy" in policy["spec"]["validations"][0]["expression"]
    assert "reinvocationPolicy" in policy["spec"]["validations"][1]["expression"]
    for values in ("kubeletPlugin.sharedGpuTenants=any", "webhook.enabled=false"):
        docs = render(helm, values)
        mutating = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
        assert not [d for d in mutating if "tenancy" in d["metadata"]["name"]], values
        role = find(docs, "ClusterRole", "controller")
        assert not any("t-flexgpu-tenancy" in r.get("resourceNames", []) for r in role["rules"]), (
            values
        )
        args = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert not any(a.startswith("--tenant-webhook") for a in args), values


def test_webhook_configuration_is_the_controllers_own(helm: Path) -> None:
    """The chart's ValidatingWebhookConfiguration has exactly the webhooks the controller
    builds (controller/webhook_config.py), reached through the controller's Service, with no
    caBundle (the controller fills it in; an upgrade leaves it)."""
    from flexgpu.controller.webhook_config import ServiceRef, build_webhook_configuration

    rendered = find(render(helm), "ValidatingWebhookConfiguration")
    assert rendered["metadata"]["name"] == "t-flexgpu-validation"
    built = build_webhook_configuration(
        ServiceRef("flexgpu-system", "t-flexgpu-controller", 443), None, name="unused"
    )
    assert rendered["webhooks"] == built["webhooks"]
    assert all("caBundle" not in w["clientConfig"] for w in rendered["webhooks"])
    policies = [w for w in rendered["webhooks"] if w["name"] == "gpunodepolicies.flexgpu.dev"]
    assert [w["failurePolicy"] for w in policies] == ["Fail"]


def test_mps_daemon_pod_policy_names_the_release_image_and_paths(helm: Path) -> None:
    docs = render(helm, "image.tag=1.2.3", "kubeletPlugin.mpsRoot=/srv/mps/")
    policy = find(docs, "ValidatingAdmissionPolicy", "mps-pods")["spec"]
    text = str(policy["validations"])
    assert '"ghcr.io/flexgpu/flexgpu:1.2.3"' in text
    assert '"/srv/mps"' in text and '"/srv/mps/lib"' in text
    # The daemon's folders under the MPS root, named by the pod's own GPU UUID.
    assert '"/srv/mps/" + variables.uuid' in str(policy["variables"])
    assert 'o.name == "t-flexgpu-kubelet-plugin"' in text  # owned by the plugin's DaemonSet
    assert policy["matchConditions"][0]["expression"] == (
        "request.userInfo.username == "
        '"system:serviceaccount:flexgpu-system:t-flexgpu-kubelet-plugin"'
    )
    for off in ("kubeletPlugin.mpsDaemonPods=false", "kubeletPlugin.nvidiaDriverRoot="):
        names = {d["metadata"]["name"] for d in render(helm, off)}
        assert not {n for n in names if n.endswith("mps-pods")}, off


# --------------------------------------------------------------------------- conventions


def _pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["kind"]: d["spec"]["template"] for d in docs if d["kind"] in ("DaemonSet", "Deployment")
    }


def test_names_follow_the_overrides(helm: Path) -> None:
    names = {d["metadata"]["name"] for d in render(helm, "fullnameOverride=gpu")}
    assert {"gpu-kubelet-plugin", "gpu-controller", "gpu-validation"} <= names
    names = {d["metadata"]["name"] for d in render(helm, "nameOverride=acc")}
    assert {"t-acc-kubelet-plugin", "t-acc-controller"} <= names
    labels = find(render(helm, "nameOverride=acc"), "DaemonSet")["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "acc"


def test_existing_service_accounts_get_the_roles_and_policies(helm: Path) -> None:
    docs = render(
        helm,
        "kubeletPlugin.serviceAccount.create=false",
        "kubeletPlugin.serviceAccount.name=gpu-plugin",
        "controller.serviceAccount.create=false",
        "controller.serviceAccount.name=gpu-ctl",
    )
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    templates = _pod_templates(docs)
    assert templates["DaemonSet"]["spec"]["serviceAccountName"] == "gpu-plugin"
    assert templates["Deployment"]["spec"]["serviceAccountName"] == "gpu-ctl"
    subjects = {
        s["name"]
        for d in docs
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
        for s in d["subjects"]
    }
    assert subjects == {"gpu-plugin", "gpu-ctl"}
    for policy in (d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"):
        expression = policy["spec"]["matchConditions"][0]["expression"]
        assert expression.endswith((':gpu-plugin"', ':gpu-ctl"')), expression
    annotated = render(helm, "controller.serviceAccount.annotations.team=ml")
    assert find(annotated, "ServiceAccount", "controller")["metadata"]["annotations"] == {
        "team": "ml"
    }
    result = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--set", "controller.serviceAccount.create=false"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "controller.serviceAccount.name is required" in result.stderr


def test_pods_carry_recommended_labels_annotations_and_security_contexts(helm: Path) -> None:
    docs = render(
        helm,
        "controller.podLabels.team=ml",
        "kubeletPlugin.podAnnotations.scrape=yes",
        "controller.podSecurityContext.runAsUser=1000",
        "controller.securityContext.readOnlyRootFilesystem=false",
        "kubeletPlugin.podSecurityContext.fsGroup=7",
    )
    templates = _pod_templates(docs)
    for kind, component in (("DaemonSet", "kubelet-plugin"), ("Deployment", "controller")):
        labels = templates[kind]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "flexgpu"
        assert labels["app.kubernetes.io/instance"] == "t"
        assert labels["app.kubernetes.io/component"] == component
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        # The selectors stay what the first release had: they cannot change on upgrade.
        workload = find(docs, kind)
        assert workload["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/instance": "t",
            "app.kubernetes.io/component": component,
        }
    assert templates["Deployment"]["metadata"]["labels"]["team"] == "ml"
    assert templates["DaemonSet"]["metadata"]["annotations"] == {"scrape": "yes"}
    controller = templates["Deployment"]["spec"]
    assert controller["securityContext"]["runAsUser"] == 1000
    assert controller["securityContext"]["runAsNonRoot"] is True
    container = controller["containers"][0]["securityContext"]
    assert container["readOnlyRootFilesystem"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    plugin = templates["DaemonSet"]["spec"]
    assert plugin["securityContext"] == {"fsGroup": 7}
    assert plugin["containers"][0]["securityContext"] == {"privileged": True}


def test_log_settings_reach_both_daemons_as_they_parse_them(helm: Path) -> None:
    from flexgpu.controller.main import build_parser
    from flexgpu.kubelet_plugin.config_flags import load_config

    templates = _pod_templates(render(helm, "logLevel=debug", "logFormat=text"))
    plugin_args = templates["DaemonSet"]["spec"]["containers"][0]["args"]
    assert plugin_args == ["--log-level=debug", "--log-format=text"]
    config = load_config([*plugin_args, "--node-name=n"], environ={})
    assert (config.log_level, config.log_format) == ("debug", "text")
    controller_args = templates["Deployment"]["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(controller_args)
    assert (parsed.log_level, parsed.log_format) == ("debug", "text")
    defaults = _pod_templates(render(helm))
    assert "--log-format=json" in defaults["Deployment"]["spec"]["containers"][0]["args"]


def test_controller_is_ready_when_serving_protected_and_prioritised(helm: Path) -> None:
    docs = render(helm)
    spec = _pod_templates(docs)["Deployment"]["spec"]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["containers"][0]["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == find(docs, "Deployment")["spec"]["selector"]
    plugin = _pod_templates(docs)["DaemonSet"]["spec"]
    assert plugin["priorityClassName"] == "system-node-critical"
    off = render(helm, "webhook.enabled=false", "controller.podDisruptionBudget.enabled=false")
    probe = _pod_templates(off)["Deployment"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert not [d for d in off if d["kind"] == "PodDisruptionBudget"]


def test_schema_accepts_global_and_still_rejects_typos(helm: Path) -> None:
    assert render(helm, "global.imageRegistry=registry.example")
    for typo in (
        "controller.podLabel.team=ml",
        "logLevel=verbose",
        "kubeletPlugin.serviceAcount.create=false",
    ):
        result = subprocess.run(
            [str(helm), "template", "t", str(CHART), "--set", typo],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode != 0, typo


def _app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def _images(docs: list[dict[str, Any]]) -> set[str]:
    pods = _pod_templates(docs)
    return {c["image"] for spec in pods.values() for c in spec["spec"]["containers"]}


def test_image_registry_mirror_and_digest(helm: Path) -> None:
    """The image is registry/repository:appVersion by default; a global mirror replaces the
    registry of both daemons and the MPS daemon pods; a digest pins the exact image."""
    default = render(helm)
    assert _images(default) == {"ghcr.io/flexgpu/flexgpu:" + _app_version()}
    mirrored = render(helm, "global.imageRegistry=mirror.corp:5000", "image.tag=1.2.3")
    assert _images(mirrored) == {"mirror.corp:5000/flexgpu/flexgpu:1.2.3"}
    digest = "sha256:" + "ab" * 32
    pinned = render(helm, f"image.digest={digest}", "image.tag=1.2.3")
    assert _images(pinned) == {f"ghcr.io/flexgpu/flexgpu@{digest}"}
    env = _pod_templates(pinned)["DaemonSet"]["spec"]["containers"][0]["env"]
    mps_image = [e["value"] for e in env if e["name"] == "FLEXGPU_MPS_IMAGE"]
    assert mps_image == [f"ghcr.io/flexgpu/flexgpu@{digest}"]
    whole = render(helm, "image.registry=", "image.repository=local/flexgpu", "image.tag=t")
    assert _images(whole) == {"local/flexgpu:t"}


def test_bad_digest_is_refused_naming_the_value(helm: Path) -> None:
    result = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--set", "image.digest=latest"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "digest" in result.stderr and "sha256" in result.stderr


def test_update_strategy_and_extra_env_and_volumes(helm: Path) -> None:
    daemonset = next(d for d in render(helm) if d["kind"] == "DaemonSet")
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    docs = render(
        helm,
        "kubeletPlugin.updateStrategy.rollingUpdate.maxSurge=10%",
        "kubeletPlugin.extraEnv[0].name=HTTPS_PROXY",
        "kubeletPlugin.extraEnv[0].value=http://proxy:3128",
        "kubeletPlugin.extraVolumes[0].name=ca",
        "kubeletPlugin.extraVolumes[0].hostPath.path=/etc/pki",
        "kubeletPlugin.extraVolumeMounts[0].name=ca",
        "kubeletPlugin.extraVolumeMounts[0].mountPath=/etc/pki",
        "controller.extraEnv[0].name=TZ",
        "controller.extraEnv[0].value=UTC",
        "controller.extraVolumes[0].name=scratch",
        "controller.extraVolumes[0].emptyDir.medium=Memory",
        "controller.extraVolumeMounts[0].name=scratch",
        "controller.extraVolumeMounts[0].mountPath=/scratch",
    )
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == "10%"
    pods = _pod_templates(docs)
    for kind, env, volume, mount in (
        ("DaemonSet", "HTTPS_PROXY", "ca", "/etc/pki"),
        ("Deployment", "TZ", "scratch", "/scratch"),
    ):
        spec = pods[kind]["spec"]
        container = spec["containers"][0]
        assert env in {e["name"] for e in container["env"]}
        assert volume in {v["name"] for v in spec["volumes"]}
        assert {"name": volume, "mountPath": mount} in container["volumeMounts"]


@pytest.mark.parametrize(
    ("value", "api"),
    [
        ("metrics.serviceMonitor.enabled", "monitoring.coreos.com/v1"),
        ("metrics.prometheusRule.enabled", "monitoring.coreos.com/v1"),
        ("webhook.certManager.enabled", "cert-manager.io/v1"),
    ],
)
def test_optional_objects_need_their_api(helm: Path, value: str, api: str) -> None:
    """A ServiceMonitor, PrometheusRule or cert-manager Certificate on a cluster without that
    API fails the render naming the value and what to install, not the install halfway."""
    result = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--set", f"{value}=true"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert f"{value} is true but the cluster serves no {api}" in result.stderr


def test_preflight_runs_before_the_plugin(helm: Path) -> None:
    """`flexgpu doctor node` runs as the plugin pod's init container over the same driver root
    and folders, recording its verdict on the Node; strict makes a failed check fatal."""
    spec = _pod_templates(render(helm))["DaemonSet"]["spec"]
    (init,) = spec["initContainers"]
    assert init["command"] == ["flexgpu", "doctor", "node", "--record-event=$(FLEXGPU_NODE_NAME)"]
    assert "--strict" not in (init.get("args") or [])
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["FLEXGPU_DRIVER_ROOT"] == "/driver-root"
    assert env["FLEXGPU_CDI_DIR"] == "/var/run/cdi"
    assert init["image"] == spec["containers"][0]["image"]
    assert {
        "name": "driver-root",
        "mountPath": "/driver-root",
        "readOnly": True,
        "mountPropagation": "HostToContainer",
    } in init["volumeMounts"]
    strict = _pod_templates(render(helm, "kubeletPlugin.preflight.strict=true"))
    assert "--strict" in strict["DaemonSet"]["spec"]["initContainers"][0]["args"]
    off = _pod_templates(render(helm, "kubeletPlugin.preflight.enabled=false"))
    assert "initContainers" not in off["DaemonSet"]["spec"]


def test_plugin_probes_ask_the_plugin_over_http(helm: Path) -> None:
    """Startup, liveness and readiness probes are HTTP requests the plugin answers itself
    (no process per check); healthPort 0 falls back to the exec liveness probe alone."""
    container = _pod_templates(render(helm))["DaemonSet"]["spec"]["containers"][0]
    assert {"name": "health", "containerPort": 8083} in container["ports"]
    assert {"name": "FLEXGPU_HEALTH_PORT", "value": "8083"} in container["env"]
    assert container["startupProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    off = _pod_templates(render(helm, "kubeletPlugin.healthPort=0"))["DaemonSet"]["spec"]
    plugin = off["containers"][0]
    assert "exec" in plugin["livenessProbe"] and "readinessProbe" not in plugin


def test_namespace_override_moves_every_namespaced_object(helm: Path) -> None:
    """namespaceOverride puts every namespaced object, and every reference to the namespace
    (ServiceAccount usernames in the admission policies, the webhook Service, the controller's
    flags), into that namespace instead of the release's."""
    docs = render(helm, "namespaceOverride=gpu-system")
    namespaced = [d for d in docs if "namespace" in d["metadata"]]
    # Node Events live in `default`, as the kubelet's do: the rights to write them stay there.
    in_default = {d["kind"] for d in namespaced if d["metadata"]["namespace"] == "default"}
    assert in_default <= {"Role", "RoleBinding"}
    assert {d["metadata"]["namespace"] for d in namespaced} - {"default"} == {"gpu-system"}
    text = yaml.safe_dump_all(docs)
    assert "flexgpu-system" not in text
    assert "system:serviceaccount:gpu-system:t-flexgpu-kubelet-plugin" in text


def test_mps_daemon_priority_and_resources_are_values(helm: Path) -> None:
    """kubeletPlugin.mpsDaemon reaches the plugin (which renders the pods) and the admission
    policy (which admits exactly that) alike."""
    docs = render(
        helm,
        "kubeletPlugin.mpsDaemon.priorityClassName=gpu-daemons",
        "kubeletPlugin.mpsDaemon.resources.requests.memory=64Mi",
        "kubeletPlugin.mpsDaemon.resources.limits.memory=1Gi",
    )
    env = {
        e["name"]: e.get("value")
        for e in _pod_templates(docs)["DaemonSet"]["spec"]["containers"][0]["env"]
    }
    assert env["FLEXGPU_MPS_PRIORITY_CLASS"] == "gpu-daemons"
    assert json.loads(env["FLEXGPU_MPS_RESOURCES"]) == {
        "requests": {"cpu": "10m", "memory": "64Mi"},
        "limits": {"memory": "1Gi"},
    }
    spec = find(docs, "ValidatingAdmissionPolicy", "mps-pods")["spec"]
    policy = "\n".join(v["expression"] for v in spec["validations"])
    assert 'priorityClassName.orValue("") == "gpu-daemons"' in policy
    assert 'requests.orValue({}) == {"cpu":"10m","memory":"64Mi"}' in policy
    assert 'limits.orValue({}) == {"memory":"1Gi"}' in policy


@pytest.mark.parametrize(
    ("kube_version", "values", "expected"),
    [
        ("1.37.2", (), "nvidia.com/gpu"),  # auto: GA, as NVIDIA's own DRA chart
        ("1.36.1", (), None),  # auto: beta, an admin may have the gate off
        ("1.37.2", ("deviceClasses.gpuExtendedResourceName=",), None),
        ("1.35.0", ("deviceClasses.gpuExtendedResourceName=example.com/gpu",), "example.com/gpu"),
    ],
)
def test_whole_gpu_class_serves_nvidia_gpu_by_default_where_it_is_ga(
    helm: Path, kube_version: str, values: tuple[str, ...], expected: str | None
) -> None:
    docs = render(helm, *values, kube_version=kube_version)
    spec = next(
        d for d in docs if d["kind"] == "DeviceClass" and d["metadata"]["name"] == "gpu.flexgpu.dev"
    )["spec"]
    assert spec.get("extendedResourceName") == expected
