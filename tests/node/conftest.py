"""One real GPU node (upstream kubelet + containerd + runc, simulated driver root) for the
whole session, with the chart's plugin DaemonSet running on it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tools.cluster import ControlPlane
from tools.node import chart, preflight
from tools.node.node import RealNode

NODE = "real-gpu-node"
TOPOLOGY = "hgx-h100-8"
# Whole GPUs 0-3 (one NVLink domain with the rest), 4 partitioned on demand, 5 shared by
# fractions; 6 and 7 carry static MIG in this topology.
DYNAMIC_MIG_GPUS = "4"
SHARED_GPUS = "5"
KUBELET_MINOR = 37
RELEASE = "flexgpu"
PLUGIN_NAMESPACE = "flexgpu-system"


@pytest.fixture(scope="session")
def real_node(cluster: ControlPlane) -> Iterator[RealNode]:
    found = preflight.problems()
    match = re.search(r"v1\.(\d+)\.", cluster.version)
    if match and int(match.group(1)) < KUBELET_MINOR:
        # Version skew policy: a kubelet may not be newer than its API server.
        found.append(
            f"the real node's kubelet is v1.{KUBELET_MINOR}; the control plane runs "
            f"{cluster.version.split()[-1]}, older than its kubelet"
        )
    if found:
        reason = "no real node: " + "; ".join(found)
        print(reason)
        pytest.skip(reason)
    node = RealNode(cluster, NODE, gpus=8, labels={"flexgpu.dev/topology": TOPOLOGY})
    node.start()
    try:
        yield node
    finally:
        node.cleanup()


def install_plugin(node: RealNode, image: str, shared_gpus: str = SHARED_GPUS) -> Any:
    chart.install(
        node,
        release=RELEASE,
        namespace=PLUGIN_NAMESPACE,
        image=image,
        topology=TOPOLOGY,
        extra=(
            "--set-string",
            f"kubeletPlugin.dynamicMigGpus={DYNAMIC_MIG_GPUS}",
            "--set-string",
            f"kubeletPlugin.sharedGpus={shared_gpus}",
        ),
    )
    return chart.wait_plugin_serving(node, PLUGIN_NAMESPACE, image=image)


@pytest.fixture(scope="session")
def plugin(real_node: RealNode) -> Iterator[RealNode]:
    install_plugin(real_node, real_node.flexgpu_image)
    try:
        yield real_node
    finally:
        chart.uninstall(real_node, release=RELEASE, namespace=PLUGIN_NAMESPACE)
