"""The real node as NVIDIA's GPU Operator leaves it with its device plugin turned off
(docs/gpu-operator.md): every label the Operator sets (nvidia.com/gpu.deploy.device-plugin=true
among them), the driver under /run/nvidia/driver from its driver container with the
validator's ready files, the container toolkit's CDI spec beside flexgpu's, and the driver
upgrade state label. The chart installed by the docs' recipe (nvidiaDriverRoot=/run/nvidia/driver)
runs its plugin there and a GPU pod gets its GPU with the driver's files from that root."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import wait_for
from tests.node.conftest import (
    DYNAMIC_MIG_GPUS,
    NODE,
    PLUGIN_NAMESPACE,
    RELEASE,
    SHARED_GPUS,
    TOPOLOGY,
    install_plugin,
)
from tests.node.support import (
    assert_control_nodes_usable,
    claim_uid,
    claim_uuids,
    create_claim,
    delete_pods,
    gpu_request,
    one_claim_pod,
    run_pod,
    wait_report,
)
from tools.node import chart
from tools.node.node import RealNode

OPERATOR_DRIVER_ROOT = "/run/nvidia/driver"
# What the Operator sets on a GPU node (controllers/state_manager.go: gpuStateLabels for the
# container workload, set whether or not devicePlugin.enabled) and its upgrade controller's
# state label.
OPERATOR_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.deploy.operands": "true",
    "nvidia.com/gpu.deploy.driver": "true",
    "nvidia.com/gpu.deploy.gpu-feature-discovery": "true",
    "nvidia.com/gpu.deploy.container-toolkit": "true",
    "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/gpu.deploy.dcgm": "true",
    "nvidia.com/gpu.deploy.dcgm-exporter": "true",
    "nvidia.com/gpu.deploy.node-status-exporter": "true",
    "nvidia.com/gpu.deploy.operator-validator": "true",
    "nvidia.com/gpu.deploy.client": "true",
    "nvidia.com/gpu-driver-upgrade-state": "upgrade-done",
}
# The toolkit's CDI spec with CDI on (its daemonset's CDI_ENABLED, kind
# management.nvidia.com/gpu); its device is for management containers only.
TOOLKIT_SPEC = "management.nvidia.com-gpu.yaml"


def _toolkit_spec() -> dict[str, Any]:
    return {
        "cdiVersion": "0.5.0",
        "kind": "management.nvidia.com/gpu",
        "devices": [
            {
                "name": "all",
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia0"}]
                },
            }
        ],
        "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]},
    }


def _driver_root_of(pod: Any) -> str | None:
    for volume in pod.spec.volumes or []:
        if volume.name == "driver-root" and volume.host_path is not None:
            return str(volume.host_path.path)
    return None


@pytest.fixture
def operator_node(api: Any, plugin: RealNode) -> Iterator[RealNode]:
    """The session's node shaped as the Operator leaves it, the chart installed again by
    the recipe; put back as it was afterwards."""
    core = client.CoreV1Api(api)
    before = dict(core.read_node(NODE).metadata.labels or {})
    core.patch_node(NODE, {"metadata": {"labels": OPERATOR_LABELS}})
    spec = plugin.layout.cdi_dir / TOOLKIT_SPEC
    spec.write_text(yaml.safe_dump(_toolkit_spec()))
    try:
        chart.install(
            plugin,
            release=RELEASE,
            namespace=PLUGIN_NAMESPACE,
            image=plugin.flexgpu_image,
            topology=TOPOLOGY,
            extra=(
                "--set-string",
                f"kubeletPlugin.dynamicMigGpus={DYNAMIC_MIG_GPUS}",
                "--set-string",
                f"kubeletPlugin.sharedGpus={SHARED_GPUS}",
                # The recipe of docs/gpu-operator.md.
                "--set",
                f"kubeletPlugin.nvidiaDriverRoot={OPERATOR_DRIVER_ROOT}",
            ),
        )

        def rolled() -> bool:
            pods = chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
            return bool(pods) and all(_driver_root_of(p) == OPERATOR_DRIVER_ROOT for p in pods)

        wait_for(rolled, timeout_s=180, what="the plugin pod of the recipe to replace the old one")
        chart.wait_plugin_serving(plugin, PLUGIN_NAMESPACE, image=plugin.flexgpu_image)
        yield plugin
    finally:
        spec.unlink(missing_ok=True)
        # The labels as they were (the node had nvidia.com/gpu.present=true already).
        restored = {key: before.get(key) for key in OPERATOR_LABELS}
        core.patch_node(NODE, {"metadata": {"labels": restored}})
        install_plugin(plugin, plugin.flexgpu_image)

        def back() -> bool:
            pods = chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
            return bool(pods) and all(_driver_root_of(p) != OPERATOR_DRIVER_ROOT for p in pods)

        wait_for(back, timeout_s=180, what="the plugin pod of the session's values again")
        chart.wait_plugin_serving(plugin, PLUGIN_NAMESPACE, image=plugin.flexgpu_image)


def test_the_recipe_serves_a_gpu_operator_node(
    api: Any, namespace: str, operator_node: RealNode
) -> None:
    """The plugin runs on the node although the Operator labelled it for a device plugin
    (none runs), publishes, and a pod gets its one GPU; the claim's CDI spec names the
    driver's files under /run/nvidia/driver, and the container finds NVML's library there."""
    node = client.CoreV1Api(api).read_node(NODE)
    assert node.metadata.labels["nvidia.com/gpu.deploy.device-plugin"] == "true"
    assert not int((node.status.allocatable or {}).get("nvidia.com/gpu", "0"))

    create_claim(api, namespace, "op", {"requests": [gpu_request()]})
    run_pod(api, namespace, one_claim_pod(operator_node, "op", "op"))
    rep = wait_report(operator_node, namespace, "op")
    assert set(rep.visible_devices) == claim_uuids(api, namespace, "op")
    assert_control_nodes_usable(rep)
    assert any(f.endswith("libnvidia-ml.so.1") for f in rep.files), rep.files
    uid = claim_uid(api, namespace, "op")
    (spec,) = operator_node.layout.cdi_dir.glob(f"*{uid}*")
    text = spec.read_text()
    assert f"{OPERATOR_DRIVER_ROOT}/" in text, text[:2000]
    assert str(operator_node.layout.driver_root) not in text
    delete_pods(api, namespace, "op")
