"""The chart installed for real with helm on the local cluster. Its rendered manifests pass
the apiserver's server-side validation; the plugin and controller then run as local
processes authenticated as the chart's ServiceAccounts (tokens from the TokenRequest API,
the plugin's bound to its node like a real pod's), so the chart's RBAC and admission policy
are what is exercised: sufficient (a GPU pod runs, the controller leads and explains) and
minimal (a plugin cannot write another node's slices or read Secrets)."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client, config

from flexgpu.driver.backend import GpuBackend
from flexgpu.kubelet_plugin.agents.mps_pods import MpsDaemonPods
from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from tests.conftest import target_minor, wait_for
from tests.integration.gpu_workloads import (
    create_claim,
    default_chart_image,
    env_from_log,
    gpu_request,
    granted,
    make_pod,
    policy_webhook_ignored,
    wait_container_output,
    wait_phase,
)
from tools.cluster import ControlPlane, create_simulated_node
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.cluster.process import Component
from tools.cluster.tokens import service_account_kubeconfig

pytestmark = pytest.mark.integration

NS = "flexgpu-system"
RELEASE = "flexgpu"
PLUGIN_SA = "flexgpu-kubelet-plugin"
CONTROLLER_SA = "flexgpu-controller"
NODE_A, NODE_B = "chart-node-a", "chart-node-b"
# The chart's name for the controller's webhook configuration (its RBAC allows no other).
WEBHOOK_CONFIGURATION = "flexgpu-validation"
POLICIES = ("flexgpu.dev", "v1alpha1", "gpunodepolicies")
MERGE_PATCH = "application/merge-patch+json"


def run(*argv: str, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        check=False,
    )


def _mps_root(cluster: ControlPlane) -> Path:
    return cluster.workdir / "chart-mps"


@pytest.fixture(scope="module")
def installed(cluster: ControlPlane) -> Iterator[Path]:
    tools = helm_tools_dir()
    # The MPS root is a chart value the MPS pod admission policy names; a folder of the test's.
    mps_root = f"kubeletPlugin.mpsRoot={_mps_root(cluster)}"
    rendered = run(
        str(tools / "helm"),
        "template",
        RELEASE,
        str(REPO_ROOT / "charts/flexgpu"),
        "--namespace",
        NS,
        "--include-crds",
        "--set",
        mps_root,
        kubeconfig=cluster.kubeconfig,
    )
    assert rendered.returncode == 0, rendered.stderr
    manifest = cluster.workdir / "chart.yaml"
    manifest.write_text(rendered.stdout)
    dry = run(str(tools / "kubectl"), "create", "namespace", NS, kubeconfig=cluster.kubeconfig)
    dry = run(
        str(tools / "kubectl"),
        "apply",
        "--dry-run=server",
        "-f",
        str(manifest),
        kubeconfig=cluster.kubeconfig,
    )
    assert dry.returncode == 0, dry.stderr
    # DeviceClasses may already exist from other tests of this session: adopt them.
    install = run(
        str(tools / "helm"),
        "upgrade",
        "--install",
        RELEASE,
        str(REPO_ROOT / "charts/flexgpu"),
        "--namespace",
        NS,
        "--take-ownership",
        "--wait=false",
        "--set",
        mps_root,
        kubeconfig=cluster.kubeconfig,
    )
    assert install.returncode == 0, install.stderr
    yield tools
    run(str(tools / "helm"), "uninstall", RELEASE, "--namespace", NS, kubeconfig=cluster.kubeconfig)


@pytest.mark.core
def test_plugin_as_its_service_account_serves_a_gpu_pod(
    cluster: ControlPlane, api: Any, namespace: str, installed: Path
) -> None:
    create_simulated_node(api, NODE_A)
    plugin_config = service_account_kubeconfig(
        api, cluster.kubeconfig, NS, PLUGIN_SA, cluster.workdir / "plugin-a.kubeconfig", node=NODE_A
    )
    node = SimulatedGpuNode(
        cluster.kubeconfig, NODE_A, "l4-2-pcie", plugin_kubeconfig=plugin_config
    )
    try:
        node.start()
        create_claim(api, namespace, "c", {"requests": [gpu_request()]})
        client.CoreV1Api(api).create_namespaced_pod(
            namespace,
            make_pod(
                "p",
                "env | grep ^FLEXGPU_DEVICE_; echo DONE; sleep 60",
                {"g": {"resourceClaimName": "c"}},
                NODE_A,
            ),
        )
        wait_phase(api, namespace, "p", {"Running"})
        env = env_from_log(wait_container_output(node, namespace, "p", "DONE"))
        assert [d["uuid"][:4] for d in granted(env)] == ["GPU-"]
        # Writing the claim's device status needs resourceclaims/driver on its own node.
        resource = client.ResourceV1Api(api)
        wait_for(
            lambda: resource.read_namespaced_resource_claim("c", namespace).status.devices,
            what="status.devices written with the plugin's own credentials",
        )
        assert "Forbidden" not in node.plugin.log_tail(300) if node.plugin else False
    finally:
        node.cleanup()


def test_plugin_as_its_service_account_makes_a_partition_before_binding(
    cluster: ControlPlane, api: Any, namespace: str, installed: Path
) -> None:
    """Binding conditions with the chart's rights: the plugin lists and watches claims, and
    writes PartitionReady into the status of a claim allocated on its node whose pod is not
    bound yet (the apiserver finds the node in the allocation, not in a pod)."""
    if target_minor() < 36:
        pytest.skip("binding conditions are on from 1.36")
    create_simulated_node(api, NODE_A)
    plugin_config = service_account_kubeconfig(
        api, cluster.kubeconfig, NS, PLUGIN_SA, cluster.workdir / "plugin-a.kubeconfig", node=NODE_A
    )
    node = SimulatedGpuNode(
        cluster.kubeconfig,
        NODE_A,
        "h200-4",
        plugin_kubeconfig=plugin_config,
        plugin_args=("--dynamic-mig-gpus=0",),
    )
    is_1g = 'device.attributes["gpu.flexgpu.dev"].profile == "1g.18gb"'
    mig = {"deviceClassName": "mig.flexgpu.dev", "selectors": [{"cel": {"expression": is_1g}}]}
    try:
        node.start()
        create_claim(api, namespace, "m", {"requests": [{"name": "mig", "exactly": mig}]})
        client.CoreV1Api(api).create_namespaced_pod(
            namespace,
            make_pod("p", "echo DONE; sleep 60", {"g": {"resourceClaimName": "m"}}, NODE_A),
        )
        # Bound at all only once PartitionReady was set: prepare comes after binding.
        wait_phase(api, namespace, "p", {"Running"}, timeout_s=90)
        assert node.plugin is not None and "for claim" in node.plugin.log_tail(300)
        assert "before binding" in node.plugin.log_tail(300)
        claim = client.ResourceV1Api(api).read_namespaced_resource_claim("m", namespace)
        (entry,) = claim.status.devices
        kinds = {(c.type, c.status) for c in entry.conditions}
        assert ("gpu.flexgpu.dev/PartitionReady", "True") in kinds
        assert "Forbidden" not in node.plugin.log_tail(300) if node.plugin else False
    finally:
        node.cleanup()


@pytest.mark.core
def test_plugin_rbac_is_minimal(cluster: ControlPlane, api: Any, installed: Path) -> None:
    create_simulated_node(api, NODE_A)
    create_simulated_node(api, NODE_B)
    kubeconfig = service_account_kubeconfig(
        api,
        cluster.kubeconfig,
        NS,
        PLUGIN_SA,
        cluster.workdir / "plugin-min.kubeconfig",
        node=NODE_A,
    )
    as_plugin = config.new_client_from_config(config_file=str(kubeconfig))
    resource: Any = client.ResourceV1Api(as_plugin)

    def slice_for(node: str) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-minimal-test"},
            "spec": {
                "driver": "gpu.flexgpu.dev",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [],
            },
        }

    resource.create_resource_slice(slice_for(NODE_A))  # its own node: allowed
    resource.delete_resource_slice(f"{NODE_A}-minimal-test")
    with pytest.raises(client.ApiException) as denied:
        resource.create_resource_slice(slice_for(NODE_B))
    assert denied.value.status in (403, 422)
    assert f"may only write ResourceSlices of that node, not of node '{NODE_B}'" in str(
        denied.value.body
    )
    with pytest.raises(client.ApiException) as secrets:
        client.CoreV1Api(as_plugin).list_namespaced_secret(NS)
    assert secrets.value.status == 403


@pytest.mark.core
def test_controller_as_its_service_account_leads_and_serves(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    kubeconfig = service_account_kubeconfig(
        api, cluster.kubeconfig, NS, CONTROLLER_SA, cluster.workdir / "controller.kubeconfig"
    )
    controller = Component(
        "controller",
        [
            sys.executable,
            "-m",
            "flexgpu.controller.main",
            f"--kubeconfig={kubeconfig}",
            f"--namespace={NS}",
            "--metrics-port=0",
            "--liveness-port=0",
            "--webhook-listen=127.0.0.1:0",
            "--webhook-url-host=127.0.0.1",
            f"--webhook-secret-namespace={NS}",
            "--webhook-configuration-name=flexgpu-validation",
            "--tenant-webhook-configuration-name=flexgpu-tenancy",
            "--toleration-webhook-configuration-name=flexgpu-gpu-tolerations",
            # As the chart runs it: the configuration is the chart's, the controller fills in
            # the caBundle only.
            "--webhook-ca-bundle-only",
        ],
        cluster.workdir / "logs" / "chart-controller.log",
    )
    controller.start()
    coordination: Any = client.CoordinationV1Api(api)
    try:
        lease = wait_for(
            lambda: _lease(coordination), timeout_s=60, what="controller holds its Lease"
        )
        assert lease.spec.holder_identity
        admission: Any = client.AdmissionregistrationV1Api(api)
        wait_for(
            lambda: _webhook(admission),
            timeout_s=60,
            what="caBundle written into the chart's configuration with the controller's "
            "credentials",
        )
        secret: Any = client.CoreV1Api(api).read_namespaced_secret("flexgpu-webhook-tls", NS)
        assert "tls.crt" in secret.data
        stored = admission.read_validating_webhook_configuration(WEBHOOK_CONFIGURATION)
        assert {h.client_config.ca_bundle for h in stored.webhooks} == {secret.data["ca.crt"]}
        # Nothing else changed: still the chart's Service, and still the chart's object.
        assert {h.client_config.service.name for h in stored.webhooks} == {CONTROLLER_SA}
        assert stored.metadata.annotations["meta.helm.sh/release-name"] == RELEASE
        # The tenancy webhook's configuration got the same bundle, and nothing else.
        tenancy = wait_for(
            lambda: _filled(admission.read_mutating_webhook_configuration("flexgpu-tenancy")),
            timeout_s=60,
            what="caBundle written into the chart's tenancy configuration",
        )
        assert {h.client_config.ca_bundle for h in tenancy.webhooks} == {secret.data["ca.crt"]}
        assert {h.client_config.service.name for h in tenancy.webhooks} == {CONTROLLER_SA}
        # And the pod toleration webhook's (its rules name pods, which the admission policy
        # allows for that configuration alone).
        tolerations = wait_for(
            lambda: _filled(
                admission.read_mutating_webhook_configuration("flexgpu-gpu-tolerations")
            ),
            timeout_s=60,
            what="caBundle written into the chart's toleration configuration",
        )
        assert {h.client_config.ca_bundle for h in tolerations.webhooks} == {secret.data["ca.crt"]}
        assert controller.running(), controller.log_tail()
        assert "Forbidden" not in controller.log_tail(400)
    finally:
        controller.stop()


def _lease(coordination: Any) -> Any:
    try:
        lease = coordination.read_namespaced_lease("flexgpu-controller", NS)
    except client.ApiException:
        return None
    return lease if lease.spec.holder_identity else None


def _filled(stored: Any) -> Any:
    """The configuration once every webhook has a caBundle, else None."""
    return stored if all(h.client_config.ca_bundle for h in stored.webhooks) else None


def _webhook(admission: Any) -> bool:
    try:
        stored = admission.read_validating_webhook_configuration(WEBHOOK_CONFIGURATION)
    except client.ApiException:
        return False
    return all(h.client_config.ca_bundle for h in stored.webhooks)


# --------------------------------------------------------------------------- what is denied


def _denial(call: Any, *args: Any, **kwargs: Any) -> str:
    """The refusal of an API call that must be refused (403 by RBAC, 403/422 by an admission
    policy); fails the test when the call goes through."""
    try:
        call(*args, **kwargs)
    except client.ApiException as error:
        assert error.status in (403, 422), error
        return str(error.body)
    pytest.fail(f"{getattr(call, '__name__', call)} was allowed")


def _policies_loaded(call: Any, *args: Any) -> None:
    """Admission policies take effect a moment after they are created: wait until a dry run
    of ``call`` is refused."""

    def refused() -> bool:
        try:
            call(*args, dry_run="All")
        except client.ApiException as error:
            return error.status in (403, 422)
        return False

    wait_for(refused, what=f"admission policy refusing {getattr(call, '__name__', call)}")


def _webhook_configuration(name: str, api_group: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": f"check.{api_group or 'core'}.example.com",
                "clientConfig": {"url": "https://127.0.0.1:1/check"},
                "rules": [
                    {
                        "apiGroups": [api_group],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["widgets"],
                    }
                ],
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
            }
        ],
    }


def test_controller_may_write_only_its_own_webhook_configuration(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    admin: Any = client.AdmissionregistrationV1Api(api)
    other = "another-product-validation"
    admin.create_validating_webhook_configuration(_webhook_configuration(other, "widgets.example"))
    kubeconfig = service_account_kubeconfig(
        api, cluster.kubeconfig, NS, CONTROLLER_SA, cluster.workdir / "controller-min.kubeconfig"
    )
    as_controller: Any = client.AdmissionregistrationV1Api(
        config.new_client_from_config(config_file=str(kubeconfig))
    )
    try:
        # Another product's configuration: not readable, not changeable, not deletable.
        _denial(as_controller.read_validating_webhook_configuration, other)
        body = admin.read_validating_webhook_configuration(other)
        body.webhooks[0].failure_policy = "Ignore"
        _denial(as_controller.replace_validating_webhook_configuration, other, body)
        _denial(
            as_controller.patch_validating_webhook_configuration,
            other,
            {"webhooks": [{"name": body.webhooks[0].name, "failurePolicy": "Ignore"}]},
        )
        _denial(as_controller.delete_validating_webhook_configuration, other)
        assert admin.read_validating_webhook_configuration(other).webhooks[0].failure_policy == (
            "Fail"
        )
        # The chart installs its configuration: the controller may create none at all...
        foreign = _webhook_configuration("not-flexgpu", "resource.k8s.io")
        assert _denial(as_controller.create_validating_webhook_configuration, foreign)
        ours = _webhook_configuration(WEBHOOK_CONFIGURATION, "resource.k8s.io")
        assert _denial(as_controller.create_validating_webhook_configuration, ours)
        # ... and may change in its own nothing but caBundle (test_chart_attacks.py tries more).
        own = admin.read_validating_webhook_configuration(WEBHOOK_CONFIGURATION)
        widened = _webhook_configuration(WEBHOOK_CONFIGURATION, "")
        widened["metadata"]["resourceVersion"] = own.metadata.resource_version
        _policies_loaded(
            as_controller.replace_validating_webhook_configuration, WEBHOOK_CONFIGURATION, widened
        )
        message = _denial(
            as_controller.replace_validating_webhook_configuration, WEBHOOK_CONFIGURATION, widened
        )
        assert "may only set clientConfig.caBundle of its webhooks" in message
        as_controller.patch_validating_webhook_configuration(
            WEBHOOK_CONFIGURATION,
            [{"op": "test", "path": "/metadata/name", "value": WEBHOOK_CONFIGURATION}],
            dry_run="All",
        )
    finally:
        admin.delete_validating_webhook_configuration(other)


def _taint_rule(name: str, *, effect: str = "NoSchedule", **overrides: Any) -> dict[str, Any]:
    """A DeviceTaintRule as the controller's GPU clearing writes it, with ``overrides``."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": name,
            "labels": overrides.get("labels", {"flexgpu.dev/clearing": "true"}),
        },
        "spec": {
            "deviceSelector": {
                "driver": overrides.get("driver", "gpu.flexgpu.dev"),
                "pool": "chart-node-a",
                "device": "gpu-0",
            },
            "taint": {"key": overrides.get("key", "flexgpu.dev/clearing"), "effect": effect},
        },
    }


def test_controller_may_write_only_its_own_clearing_taint_rules(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    if target_minor() < 37:
        pytest.skip("resource.k8s.io/v1 DeviceTaintRules are served from Kubernetes 1.37")
    rules = ("resource.k8s.io", "v1", "devicetaintrules")
    admin: Any = client.CustomObjectsApi(api)
    kubeconfig = service_account_kubeconfig(
        api, cluster.kubeconfig, NS, CONTROLLER_SA, cluster.workdir / "controller-rules.kubeconfig"
    )
    as_controller: Any = client.CustomObjectsApi(
        config.new_client_from_config(config_file=str(kubeconfig))
    )
    foreign = _taint_rule("someone-elses-rule", labels={})
    admin.create_cluster_custom_object(*rules, foreign)
    try:
        evicting = _taint_rule("flexgpu-clearing-evict", effect="NoExecute")
        _policies_loaded(as_controller.create_cluster_custom_object, *rules, evicting)
        # Evicting pods, another key, another driver's devices, a rule not labelled its own.
        assert "flexgpu.dev/clearing and effect NoSchedule" in _denial(
            as_controller.create_cluster_custom_object, *rules, evicting
        )
        for bad in (
            _taint_rule("flexgpu-clearing-key", key="example.com/drain"),
            _taint_rule("flexgpu-clearing-driver", driver="gpu.nvidia.com"),
            _taint_rule("flexgpu-clearing-unlabelled", labels={}),
        ):
            _denial(as_controller.create_cluster_custom_object, *rules, bad)
        # Another's rule: not deletable, not changeable (no update or patch at all).
        _denial(as_controller.delete_cluster_custom_object, *rules, "someone-elses-rule")
        _denial(
            as_controller.patch_cluster_custom_object,
            *rules,
            "someone-elses-rule",
            {"metadata": {"labels": {"flexgpu.dev/clearing": "true"}}},
        )
        assert admin.get_cluster_custom_object(*rules, "someone-elses-rule")
        # What GPU clearing needs goes through: create, list, delete its own.
        as_controller.create_cluster_custom_object(*rules, _taint_rule("flexgpu-clearing-ok"))
        listed = as_controller.list_cluster_custom_object(
            *rules, label_selector="flexgpu.dev/clearing=true"
        )
        assert [r["metadata"]["name"] for r in listed["items"]] == ["flexgpu-clearing-ok"]
        as_controller.delete_cluster_custom_object(*rules, "flexgpu-clearing-ok")
    finally:
        admin.delete_cluster_custom_object(*rules, "someone-elses-rule")


def test_controller_may_evict_no_pod_without_the_eviction_value(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    """The chart as installed here leaves controller.clearing.eviction off (the default): the
    controller's token may not evict (no pods/eviction) nor delete pods, nor read
    PodDisruptionBudgets (read as consent only where eviction is on). RBAC answers before
    the pod is looked up, so a name that exists nowhere shows the refusal."""
    kubeconfig = service_account_kubeconfig(
        api, cluster.kubeconfig, NS, CONTROLLER_SA, cluster.workdir / "controller-evict.kubeconfig"
    )
    as_controller = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    eviction = client.V1Eviction(
        api_version="policy/v1",
        kind="Eviction",
        metadata=client.V1ObjectMeta(name="any-pod", namespace="default"),
    )
    refusal = _denial(as_controller.create_namespaced_pod_eviction, "any-pod", "default", eviction)
    assert "pods/eviction" in refusal or '"eviction"' in refusal, refusal
    _denial(as_controller.delete_namespaced_pod, "any-pod", "default")
    budgets = client.PolicyV1Api(as_controller.api_client)
    refusal = _denial(budgets.list_pod_disruption_budget_for_all_namespaces)
    assert "poddisruptionbudgets" in refusal, refusal


def test_plugin_may_write_only_its_own_node_and_driver(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    create_simulated_node(api, NODE_A)
    create_simulated_node(api, NODE_B)
    kubeconfig = service_account_kubeconfig(
        api,
        cluster.kubeconfig,
        NS,
        PLUGIN_SA,
        cluster.workdir / "plugin-scope.kubeconfig",
        node=NODE_A,
    )
    as_plugin = config.new_client_from_config(config_file=str(kubeconfig))

    # ResourceSlices of another driver, even on its own node.
    resource: Any = client.ResourceV1Api(as_plugin)
    nvidia = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE_A}-other-driver"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": NODE_A,
            "pool": {"name": NODE_A, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }
    _policies_loaded(resource.create_resource_slice, nvidia)
    message = _denial(resource.create_resource_slice, nvidia)
    assert "may only write ResourceSlices of driver gpu.flexgpu.dev, not of driver " in message
    assert "gpu.nvidia.com" in message

    # GpuNodePolicy status: only its node's entry.
    objects: Any = client.CustomObjectsApi(api)
    name = "chart-rbac-status"
    policy = {
        "apiVersion": "flexgpu.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"matchLabels": {"flexgpu.dev/test": "no-such-node"}},
            "gpus": [{"selector": {"all": True}, "mode": "Whole"}],
        },
    }
    with policy_webhook_ignored(api, WEBHOOK_CONFIGURATION):
        wait_for(lambda: _create_policy(objects, policy), what="GpuNodePolicy CRD served")
    plugin_objects: Any = client.CustomObjectsApi(as_plugin)
    try:

        def patch_status(status: dict[str, Any], **kwargs: Any) -> Any:
            return plugin_objects.patch_cluster_custom_object_status(
                *POLICIES, name, {"status": status}, _content_type=MERGE_PATCH, **kwargs
            )

        own = {"nodes": {NODE_A: {"observedGeneration": 1}}}
        wait_for(
            lambda: _refused_dry_run(patch_status, {"nodes": {NODE_B: {"observedGeneration": 1}}}),
            what="policy status admission policy loaded",
        )
        message = _denial(patch_status, {"nodes": {NODE_B: {"observedGeneration": 1}}})
        assert (
            f"may only write its own entry of status.nodes, not the entry of node '{NODE_B}'"
            in (message)
        )
        _denial(patch_status, {"matchedNodes": [NODE_A]})
        patch_status(own)  # its own entry: allowed
        stored = objects.get_cluster_custom_object_status(*POLICIES, name)
        assert stored["status"]["nodes"] == {NODE_A: {"observedGeneration": 1}}
    finally:
        objects.delete_cluster_custom_object(*POLICIES, name)

    # Events: only in namespace default and only about its own Node.
    core: Any = client.CoreV1Api(as_plugin)

    def event(namespace: str, kind: str, about: str) -> dict[str, Any]:
        return {
            "metadata": {"generateName": "scope-test-", "namespace": namespace},
            "involvedObject": {"kind": kind, "name": about},
            "reason": "ScopeTest",
            "message": "checking what the plugin may record",
            "type": "Normal",
        }

    _denial(core.create_namespaced_event, NS, event(NS, "Node", NODE_A))  # RBAC
    _denial(core.create_namespaced_event, "kube-system", event("kube-system", "Node", NODE_A))
    _policies_loaded(core.create_namespaced_event, "default", event("default", "Node", NODE_B))
    message = _denial(core.create_namespaced_event, "default", event("default", "Node", NODE_B))
    assert f"may only record Events about that Node, not about Node '{NODE_B}'" in message
    _denial(core.create_namespaced_event, "default", event("default", "Pod", NODE_A))
    core.create_namespaced_event("default", event("default", "Node", NODE_A), dry_run="All")


def _create_policy(objects: Any, body: dict[str, Any]) -> bool:
    try:
        objects.create_cluster_custom_object(*POLICIES, body)
    except client.ApiException as error:
        if error.status == 409:
            return True
        if error.status == 404:
            return False
        if error.status == 500 and "failed calling webhook" in str(error.body):
            # The apiserver has not yet loaded the webhook's failurePolicy: Ignore (a loaded
            # machine showed this lag): try again.
            return False
        raise
    return True


def _refused_dry_run(patch: Any, status: dict[str, Any]) -> bool:
    try:
        patch(status, dry_run="All")
    except client.ApiException as error:
        return error.status in (403, 422)
    return False


# --------------------------------------------------------------------------- MPS daemon pods


def _plugin_daemonset(api: Any) -> dict[str, str]:
    """The owner the plugin gives its MPS daemon pods: its DaemonSet (mps_pod_spec.py)."""
    name = "flexgpu-kubelet-plugin"
    uid = client.AppsV1Api(api).read_namespaced_daemon_set(name, NS).metadata.uid
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": name, "uid": uid}


def test_plugin_may_run_only_mps_daemon_pods_on_its_node(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    """The plugin's right to create pods (for MPS daemons) holds for the pod mps_pods.py
    builds, on its own node, and for nothing else: not on another node, not another image,
    not another privileged shape; and it may delete only its node's daemon pods."""
    create_simulated_node(api, NODE_A)
    create_simulated_node(api, NODE_B)
    kubeconfig = service_account_kubeconfig(
        api,
        cluster.kubeconfig,
        NS,
        PLUGIN_SA,
        cluster.workdir / "plugin-mps.kubeconfig",
        node=NODE_A,
    )
    as_plugin: Any = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    # The pod exactly as the plugin builds it with the chart's settings (driver root mounted
    # at /driver-root from the host's /, MPS root and image from the chart).
    daemons = MpsDaemonPods(
        KubeApi.from_kubeconfig(kubeconfig),
        cast(GpuBackend, None),  # building the pod reads no GPU
        node_name=NODE_A,
        namespace=NS,
        image=default_chart_image(),
        mps_root=_mps_root(cluster),
        driver_root=Path("/driver-root"),
        host_driver_root=Path("/"),
        owner=_plugin_daemonset(api),
    )
    uuid = "GPU-0b5c1e4e-1d3a-4c55-9d5e-2c1f7a9e0001"
    pod = daemons._pod(daemons._daemon(0, uuid))

    other_node = copy.deepcopy(pod)
    other_node["spec"]["nodeName"] = NODE_B
    _policies_loaded(as_plugin.create_namespaced_pod, NS, other_node)
    message = _denial(as_plugin.create_namespaced_pod, NS, other_node)
    assert f"may only run and delete MPS daemon pods on that node, not on node '{NODE_B}'" in (
        message
    )

    other_image = copy.deepcopy(pod)
    other_image["spec"]["containers"][0]["image"] = "docker.io/library/busybox:1.36"
    message = _denial(as_plugin.create_namespaced_pod, NS, other_image)
    assert "running the chart's image" in message and "busybox" in message

    # Privileged, as the daemon is, but running a shell; or the daemon with the host's root
    # mounted writable beside it.
    shell = copy.deepcopy(pod)
    shell["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "chroot /host"]
    message = _denial(as_plugin.create_namespaced_pod, NS, shell)
    assert "runs /driver-root/usr/bin/nvidia-cuda-mps-control -f, not /bin/sh -c" in message
    host_root = copy.deepcopy(pod)
    host_root["spec"]["containers"][0]["volumeMounts"].append({"name": "host", "mountPath": "/h"})
    host_root["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    message = _denial(as_plugin.create_namespaced_pod, NS, host_root)
    assert "mounts exactly mps" in message

    not_a_daemon = copy.deepcopy(pod)
    not_a_daemon["metadata"]["name"] = "anything"
    message = _denial(as_plugin.create_namespaced_pod, NS, not_a_daemon)
    assert "not pod 'anything'" in message

    # The daemon pod itself: created, then deleted by the plugin.
    admin: Any = client.CoreV1Api(api)
    created = as_plugin.create_namespaced_pod(NS, pod)
    bystander = make_pod("bystander", "sleep 60", {}, NODE_B)
    bystander["metadata"]["namespace"] = NS
    bystander["spec"]["nodeName"] = NODE_B
    admin.create_namespaced_pod(NS, bystander)
    try:
        assert created.spec.node_name == NODE_A
        message = _denial(as_plugin.delete_namespaced_pod, "bystander", NS)
        assert f"not on node '{NODE_B}'" in message
        as_plugin.delete_namespaced_pod(created.metadata.name, NS)
    finally:
        for name in (created.metadata.name, "bystander"):
            with contextlib.suppress(client.ApiException):
                admin.delete_namespaced_pod(name, NS, grace_period_seconds=0)
