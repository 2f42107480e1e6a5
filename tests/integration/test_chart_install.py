"""The chart installed for real with helm on the local cluster. Its rendered manifests pass
the apiserver's server-side validation; the plugin and controller then run as local
processes authenticated as the chart's ServiceAccounts (tokens from the TokenRequest API,
the plugin's bound to its node like a real pod's), so the chart's RBAC and admission policy
are what is exercised: sufficient (a GPU pod runs, the controller leads and explains) and
minimal (a plugin cannot write another node's slices or read Secrets)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from tests.conftest import wait_for
from tests.integration.gpu_workloads import (
    create_claim,
    env_from_log,
    gpu_request,
    make_pod,
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


def run(*argv: str, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        check=False,
    )


@pytest.fixture(scope="module")
def installed(cluster: ControlPlane) -> Iterator[Path]:
    tools = helm_tools_dir()
    rendered = run(
        str(tools / "helm"),
        "template",
        RELEASE,
        str(REPO_ROOT / "charts/flexgpu"),
        "--namespace",
        NS,
        "--include-crds",
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
        kubeconfig=cluster.kubeconfig,
    )
    assert install.returncode == 0, install.stderr
    yield tools
    run(str(tools / "helm"), "uninstall", RELEASE, "--namespace", NS, kubeconfig=cluster.kubeconfig)


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
                "echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; echo DONE; sleep 60",
                {"g": {"resourceClaimName": "c"}},
                NODE_A,
            ),
        )
        wait_phase(api, namespace, "p", {"Running"})
        env = env_from_log(wait_container_output(node, namespace, "p", "DONE"))
        assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
        # Writing the claim's device status needs resourceclaims/driver on its own node.
        resource = client.ResourceV1Api(api)
        wait_for(
            lambda: resource.read_namespaced_resource_claim("c", namespace).status.devices,
            what="status.devices written with the plugin's own credentials",
        )
        assert "Forbidden" not in node.plugin.log_tail(300) if node.plugin else False
    finally:
        node.cleanup()


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
            "controller.main",
            f"--kubeconfig={kubeconfig}",
            f"--namespace={NS}",
            "--metrics-port=0",
            "--liveness-port=0",
            "--webhook-listen=127.0.0.1:0",
            "--webhook-url-host=127.0.0.1",
            f"--webhook-secret-namespace={NS}",
            "--webhook-configuration-name=flexgpu-chart-test",
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
            what="webhook configuration written with the controller's credentials",
        )
        secret = client.CoreV1Api(api).read_namespaced_secret("flexgpu-webhook-tls", NS)
        assert "tls.crt" in secret.data
        assert controller.running(), controller.log_tail()
        assert "Forbidden" not in controller.log_tail(400)
    finally:
        controller.stop()
        with contextlib.suppress(client.ApiException):
            client.AdmissionregistrationV1Api(api).delete_validating_webhook_configuration(
                "flexgpu-chart-test"
            )


def _lease(coordination: Any) -> Any:
    try:
        lease = coordination.read_namespaced_lease("flexgpu-controller", NS)
    except client.ApiException:
        return None
    return lease if lease.spec.holder_identity else None


def _webhook(admission: Any) -> bool:
    try:
        admission.read_validating_webhook_configuration("flexgpu-chart-test")
    except client.ApiException:
        return False
    return True
