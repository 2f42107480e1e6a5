"""Faults on the real node while GPU pods run: the kubelet restarted with prepared claims,
containerd restarted, the plugin pod deleted by hand, `helm upgrade` rolling the plugin
DaemonSet. Running pods keep their devices (their containers report them again after the
fault) and new claims are served."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.node.conftest import NODE, PLUGIN_NAMESPACE, install_plugin
from tests.node.support import (
    claim_uid,
    claim_uuids,
    create_claim,
    delete_pods,
    gpu_request,
    one_claim_pod,
    run_pod,
    sharing_config,
    wait_report,
)
from tools.images.build import build_all
from tools.node import chart, image_source, report
from tools.node.node import RealNode

pytestmark = pytest.mark.integration

DRIVER = "gpu.flexgpu.dev"


def start_gpu_pod(
    api: Any, namespace: str, node: RealNode, name: str, config: list[dict[str, Any]] | None = None
) -> report.Report:
    devices: dict[str, Any] = {"requests": [gpu_request()]}
    if config:
        devices["config"] = config
    create_claim(api, namespace, name, devices)
    run_pod(api, namespace, one_claim_pod(node, name, name))
    rep = wait_report(node, namespace, name)
    assert set(rep.visible_devices) == claim_uuids(api, namespace, name)
    return rep


def container_id(api: Any, namespace: str, pod: str) -> str:
    p: Any = client.CoreV1Api(api).read_namespaced_pod(pod, namespace)
    (status,) = p.status.container_statuses
    assert status.restart_count == 0, f"{pod} restarted"
    return str(status.container_id)


def last_seq(node: RealNode, namespace: str, pod: str) -> int:
    reports = report.parse(node.container_log(namespace, pod, "main"))
    return reports[-1].seq if reports else 0


def still_served(
    api: Any, namespace: str, node: RealNode, pod: str, before: report.Report, cid: str
) -> None:
    """The pod kept its container, and a report made after the fault shows the same GPU."""
    after = wait_report(node, namespace, pod, after=last_seq(node, namespace, pod))
    assert after.visible_devices == before.visible_devices
    assert after.devices.keys() == before.devices.keys()
    assert container_id(api, namespace, pod) == cid


def cdi_spec_removed(node: RealNode, claim_uid: str) -> None:
    wait_for(
        lambda: not list(node.layout.cdi_dir.glob(f"*{claim_uid}*")),
        timeout_s=60,
        what=f"CDI spec of claim {claim_uid} removed (claim unprepared)",
    )


def test_kubelet_restart_keeps_prepared_claims(api: Any, namespace: str, plugin: RealNode) -> None:
    before = start_gpu_pod(api, namespace, plugin, "k1")
    cid = container_id(api, namespace, "k1")
    before_uid = claim_uid(api, namespace, "k1")

    plugin.restart_kubelet()
    wait_for(lambda: plugin.plugin_registered(DRIVER), what="plugin registered again")
    still_served(api, namespace, plugin, "k1", before, cid)
    # The restarted kubelet prepares new claims and, from its checkpoint, unprepares old ones.
    start_gpu_pod(api, namespace, plugin, "k2")
    delete_pods(api, namespace, "k1", "k2")
    cdi_spec_removed(plugin, before_uid)


def test_containerd_restart_keeps_running_containers(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    before = start_gpu_pod(api, namespace, plugin, "r1")
    cid = container_id(api, namespace, "r1")
    before_uid = claim_uid(api, namespace, "r1")

    plugin.restart_containerd()
    still_served(api, namespace, plugin, "r1", before, cid)
    start_gpu_pod(api, namespace, plugin, "r2")
    delete_pods(api, namespace, "r1", "r2")
    cdi_spec_removed(plugin, before_uid)


def test_plugin_pod_deleted_by_hand(api: Any, namespace: str, plugin: RealNode) -> None:
    mps = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}
    before = start_gpu_pod(api, namespace, plugin, "p1", sharing_config(mps))
    cid = container_id(api, namespace, "p1")
    before_uid = claim_uid(api, namespace, "p1")
    (old,) = chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)

    client.CoreV1Api(api).delete_namespaced_pod(old.metadata.name, PLUGIN_NAMESPACE)
    wait_for(
        lambda: (
            all(
                p.metadata.name != old.metadata.name
                for p in chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
            )
            and chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
        ),
        timeout_s=90,
        what="the DaemonSet replaced its deleted plugin pod",
    )
    new = chart.wait_plugin_serving(plugin, PLUGIN_NAMESPACE)
    assert new.metadata.name != old.metadata.name
    # The replacement kept the MPS daemon the running claim uses.
    # (Its start-up reconcile runs after it registers: wait for its summary line.)
    wait_for(
        lambda: (
            "stopped 0 MPS daemon(s)"
            in plugin.container_log(PLUGIN_NAMESPACE, new.metadata.name, "plugin")
        ),
        what="the new plugin's start-up reconcile stopping no MPS daemon",
    )
    still_served(api, namespace, plugin, "p1", before, cid)
    start_gpu_pod(api, namespace, plugin, "p2")
    delete_pods(api, namespace, "p1", "p2")
    cdi_spec_removed(plugin, before_uid)


def test_helm_upgrade_rolls_the_plugin_while_gpu_pods_run(
    api: Any, namespace: str, plugin: RealNode
) -> None:
    before = start_gpu_pod(api, namespace, plugin, "u1")
    cid = container_id(api, namespace, "u1")
    before_uid = claim_uid(api, namespace, "u1")
    (old,) = chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
    # The release as built now (the chart and the code of one tree), pushed under a tag of
    # its own so the DaemonSet's template changes even when the build is the same; the chart
    # pulls it by that tag (image.tag) this time.
    image = build_all()["flexgpu"]
    tag = f"upgrade-{uuid.uuid4().hex[:6]}"
    plugin.image_source.push(image, tag)
    upgraded = f"{plugin.image_source.address}/{image_source.REPOSITORY}:{tag}"

    install_plugin(plugin, upgraded)
    wait_for(
        lambda: all(
            p.metadata.name != old.metadata.name
            for p in chart.plugin_pods(api, PLUGIN_NAMESPACE, NODE)
        ),
        timeout_s=90,
        what="the old plugin pod replaced",
    )
    chart.wait_plugin_serving(plugin, PLUGIN_NAMESPACE, image=upgraded)
    still_served(api, namespace, plugin, "u1", before, cid)
    start_gpu_pod(api, namespace, plugin, "u2")
    delete_pods(api, namespace, "u1", "u2")
    cdi_spec_removed(plugin, before_uid)
