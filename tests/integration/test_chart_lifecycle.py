"""The chart's life after install, with helm on the local cluster: `helm uninstall` leaves no
object of the release behind (its webhook configuration included, so GpuNodePolicy writes
work again), and an upgrade from an earlier chart (commit c9a8367, before the chart owned the
webhook configuration) along the path docs/admin.md gives keeps GpuNodePolicies and serves the
new CRD schema."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from flexgpu.controller.webhook_config import ServiceRef, build_webhook_configuration
from tests.conftest import wait_for
from tests.integration.gpu_workloads import policy_webhook_ignored
from tools.cluster import ControlPlane
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir
from tools.cluster.process import Component
from tools.cluster.tokens import service_account_kubeconfig

pytestmark = pytest.mark.integration

CHART = REPO_ROOT / "charts/flexgpu"
OLD_CHART_COMMIT = "c9a8367"
POLICIES = ("flexgpu.dev", "v1alpha1", "gpunodepolicies")
# DeviceClasses have fixed names other tests of the session use: these releases leave them be.
SHARED = ("--set", "deviceClasses.create=false")


def _run(cluster: ControlPlane, tool: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_tools_dir() / tool), *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        check=False,
    )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _policy(name: str, mps: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeSelector": {"matchLabels": {"flexgpu.dev/test": "no-such-node"}},
        "gpus": [{"selector": {"all": True}, "mode": "Whole"}],
    }
    if mps is not None:
        spec["sharing"] = {"strategy": "MPS", "mpsConfig": mps}
    return {
        "apiVersion": "flexgpu.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def _create(objects: Any, body: dict[str, Any], **kwargs: Any) -> Any:
    return objects.create_cluster_custom_object(*POLICIES, body, **kwargs)


def test_uninstall_leaves_nothing_and_policy_writes_work_again(
    cluster: ControlPlane, api: Any
) -> None:
    release, namespace = "lifecycle", "flexgpu-lifecycle"
    _ok(
        _run(
            cluster,
            "helm",
            "install",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--create-namespace",
            "--wait=false",
            *SHARED,
        )
    )
    manifest = cluster.workdir / "lifecycle-manifest.yaml"
    manifest.write_text(_ok(_run(cluster, "helm", "get", "manifest", release, "-n", namespace)))
    installed = _ok(_run(cluster, "kubectl", "get", "-f", str(manifest), "-o", "name")).split()
    kinds = {name.split("/")[0] for name in installed}
    # Every kind the chart makes (cluster-wide and in the namespace), the webhook among them.
    assert {
        "validatingwebhookconfiguration.admissionregistration.k8s.io",
        "validatingadmissionpolicy.admissionregistration.k8s.io",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io",
        "clusterrole.rbac.authorization.k8s.io",
        "clusterrolebinding.rbac.authorization.k8s.io",
        "role.rbac.authorization.k8s.io",
        "rolebinding.rbac.authorization.k8s.io",
        "serviceaccount",
        "service",
        "daemonset.apps",
        "deployment.apps",
        "poddisruptionbudget.policy",
    } <= kinds, kinds
    objects: Any = client.CustomObjectsApi(api)
    # While installed (and no controller serves it), the Fail webhook refuses policy writes.
    with pytest.raises(client.ApiException) as refused:
        _create(objects, _policy("lifecycle-before"), dry_run="All")
    assert "gpunodepolicies.flexgpu.dev" in str(refused.value.body)
    # What the controller makes at run time, made by the controller with the chart's
    # credentials and flags: the Lease, the certificate Secret, the configuration's caBundle.
    runtime = _run_controller_once(cluster, api, release, namespace)
    assert runtime["owners"] == [("Deployment", f"{release}-flexgpu-controller")] * 2

    _ok(_run(cluster, "helm", "uninstall", release, "-n", namespace, "--wait"))

    left = _run(cluster, "kubectl", "get", "-f", str(manifest), "-o", "name", "--ignore-not-found")
    assert left.returncode == 0, left.stderr
    assert left.stdout.split() == []

    # Nothing labelled with the release anywhere either (pods of the workloads included).
    # Pods go through the garbage collector after their ReplicaSet: wait for it, bounded. A pod
    # bound to a simulated node of an earlier test stays Terminating (no kubelet confirms its
    # end): being deleted is what uninstall owes, so those count as gone.
    def labelled() -> list[str]:
        listed = json.loads(
            _ok(
                _run(
                    cluster,
                    "kubectl",
                    "get",
                    "validatingwebhookconfigurations,validatingadmissionpolicies,"
                    "validatingadmissionpolicybindings,clusterroles,clusterrolebindings,roles,"
                    "rolebindings,serviceaccounts,services,daemonsets,deployments,pods,"
                    "poddisruptionbudgets,configmaps",
                    "--all-namespaces",
                    "-l",
                    f"app.kubernetes.io/instance={release}",
                    "-o",
                    "json",
                )
            )
        )
        return [
            f"{item['kind']}/{item['metadata']['name']}"
            for item in listed["items"]
            if not item["metadata"].get("deletionTimestamp")
        ]

    wait_for(
        lambda: labelled() == [],
        timeout_s=60,
        interval_s=1.0,
        what="nothing labelled with the release left",
    )
    # The run-time objects go with the Deployment that owns them (garbage collection).
    core: Any = client.CoreV1Api(api)
    coordination: Any = client.CoordinationV1Api(api)
    wait_for(
        lambda: (
            not _exists(
                coordination.read_namespaced_lease, f"{release}-flexgpu-controller", namespace
            )
            and not _exists(
                core.read_namespaced_secret, f"{release}-flexgpu-webhook-tls", namespace
            )
        ),
        what="the controller's Lease and webhook Secret deleted with its Deployment",
    )
    # GpuNodePolicy writes go through again.
    wait_for(
        lambda: _created(objects, _policy("lifecycle-after")),
        what="a GpuNodePolicy write admitted once the webhook configuration is gone",
    )
    objects.delete_cluster_custom_object(*POLICIES, "lifecycle-after")


def _exists(read: Any, name: str, namespace: str) -> bool:
    try:
        read(name, namespace)
    except client.ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def _run_controller_once(
    cluster: ControlPlane, api: Any, release: str, namespace: str
) -> dict[str, Any]:
    """Runs the controller as the release's ServiceAccount with the chart's flags (but a local
    webhook listener) until it holds its Lease, has its Secret and filled in the caBundle;
    returns the owners of the Lease and the Secret."""
    name = f"{release}-flexgpu-controller"
    kubeconfig = service_account_kubeconfig(
        api, cluster.kubeconfig, namespace, name, cluster.workdir / f"{release}-ctl.kubeconfig"
    )
    controller = Component(
        f"{release}-controller",
        [
            sys.executable,
            "-m",
            "flexgpu.controller.main",
            f"--kubeconfig={kubeconfig}",
            f"--namespace={namespace}",
            f"--owner-deployment={name}",
            f"--lease-name={name}",
            "--metrics-port=0",
            "--liveness-port=0",
            "--webhook-listen=127.0.0.1:0",
            "--webhook-url-host=127.0.0.1",
            f"--webhook-secret-namespace={namespace}",
            f"--webhook-secret-name={release}-flexgpu-webhook-tls",
            f"--webhook-configuration-name={release}-flexgpu-validation",
            "--webhook-ca-bundle-only",
        ],
        cluster.workdir / "logs" / f"{release}-controller.log",
    )
    core: Any = client.CoreV1Api(api)
    coordination: Any = client.CoordinationV1Api(api)
    admission: Any = client.AdmissionregistrationV1Api(api)

    def settled() -> bool:
        try:
            lease = coordination.read_namespaced_lease(name, namespace)
            core.read_namespaced_secret(f"{release}-flexgpu-webhook-tls", namespace)
            hooks = admission.read_validating_webhook_configuration(
                f"{release}-flexgpu-validation"
            ).webhooks
        except client.ApiException:
            return False
        return bool(lease.spec.holder_identity) and all(h.client_config.ca_bundle for h in hooks)

    controller.start()
    try:
        wait_for(settled, timeout_s=90, what="controller's Lease, Secret and caBundle")
        assert controller.running(), controller.log_tail()
        assert "Forbidden" not in controller.log_tail(400)
    finally:
        controller.stop()
    lease = coordination.read_namespaced_lease(name, namespace)
    secret = core.read_namespaced_secret(f"{release}-flexgpu-webhook-tls", namespace)
    return {
        "owners": [
            (o.kind, o.name)
            for obj in (lease, secret)
            for o in (obj.metadata.owner_references or [])
        ]
    }


def _created(objects: Any, body: dict[str, Any]) -> bool:
    try:
        _create(objects, body)
    except client.ApiException as error:
        if error.status >= 500:  # the webhook's removal not yet seen by the apiserver
            return False
        raise
    return True


def _old_chart(into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", OLD_CHART_COMMIT, "charts/"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "charts/flexgpu"


def _served_mps_properties(api: Any) -> set[str]:
    crd: Any = client.ApiextensionsV1Api(api).read_custom_resource_definition(
        "gpunodepolicies.flexgpu.dev"
    )
    raw = client.ApiClient().sanitize_for_serialization(crd)
    (version,) = [v for v in raw["spec"]["versions"] if v["name"] == "v1alpha1"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    return set(spec["sharing"]["properties"]["mpsConfig"]["properties"])


def test_upgrade_from_an_earlier_chart_keeps_policies_and_serves_the_new_crd(
    cluster: ControlPlane, api: Any, tmp_path: Path
) -> None:
    release, namespace = "upgrade", "flexgpu-upgrade"
    old = _old_chart(tmp_path)
    # The cluster as the earlier chart left it: its CRD (helm install skips a CRD that exists).
    apply_crds = ("apply", "--server-side", "--force-conflicts", "-f")
    _ok(_run(cluster, "kubectl", *apply_crds, str(old / "crds")))
    objects: Any = client.CustomObjectsApi(api)
    try:
        assert "multiUser" not in _served_mps_properties(api)
        _ok(
            _run(
                cluster,
                "helm",
                "install",
                release,
                str(old),
                "--namespace",
                namespace,
                "--create-namespace",
                "--wait=false",
                *SHARED,
            )
        )
        wait_for(
            lambda: _created(objects, _policy("survivor")), what="GpuNodePolicy on the old chart"
        )
        uid = objects.get_cluster_custom_object(*POLICIES, "survivor")["metadata"]["uid"]
        # What that chart's controller made at run time: the webhook configuration, with its
        # CA bundle.
        configuration = f"{release}-flexgpu-validation"
        admission: Any = client.AdmissionregistrationV1Api(api)
        admission.create_validating_webhook_configuration(
            build_webhook_configuration(
                ServiceRef(namespace, f"{release}-flexgpu-controller"),
                b"the old controller's CA",
                name=configuration,
            )
        )

        # docs/admin.md, "Upgrade": the CRDs first, server-side; the webhook configuration
        # handed to the release; then helm upgrade.
        _ok(_run(cluster, "kubectl", *apply_crds, str(CHART / "crds")))
        vwc = f"validatingwebhookconfiguration/{configuration}"
        _ok(_run(cluster, "kubectl", "label", vwc, "app.kubernetes.io/managed-by=Helm"))
        _ok(
            _run(
                cluster,
                "kubectl",
                "annotate",
                vwc,
                f"meta.helm.sh/release-name={release}",
                f"meta.helm.sh/release-namespace={namespace}",
            )
        )
        wait_for(lambda: "multiUser" in _served_mps_properties(api), what="new CRD schema stored")
        _ok(
            _run(
                cluster,
                "helm",
                "upgrade",
                release,
                str(CHART),
                "--namespace",
                namespace,
                "--wait=false",
                *SHARED,
            )
        )
        assert objects.get_cluster_custom_object(*POLICIES, "survivor")["metadata"]["uid"] == uid
        # The release owns the configuration now and kept the controller's CA bundle.
        adopted = _ok(_run(cluster, "helm", "get", "manifest", release, "-n", namespace))
        assert f"name: {configuration}" in adopted
        stored = admission.read_validating_webhook_configuration(configuration)
        assert {h.client_config.ca_bundle for h in stored.webhooks} == {
            base64.b64encode(b"the old controller's CA").decode()
        }
        # The new schema is served: a field only it knows is kept, not pruned.
        with policy_webhook_ignored(api, configuration):
            wait_for(
                lambda: _created(objects, _policy("new-field", {"multiUser": True})),
                what="GpuNodePolicy with a field of the new schema",
            )
        policy = objects.get_cluster_custom_object(*POLICIES, "new-field")
        assert policy["spec"]["sharing"]["mpsConfig"]["multiUser"] is True
    finally:
        _run(cluster, "kubectl", *apply_crds, str(CHART / "crds"))
        _run(cluster, "helm", "uninstall", release, "-n", namespace, "--wait")
        for name in ("survivor", "new-field"):
            with contextlib.suppress(client.ApiException):
                objects.delete_cluster_custom_object(*POLICIES, name)
