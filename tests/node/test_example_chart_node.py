"""The reference DRA driver (sigs.k8s.io/dra-example-driver) as its upstream chart deploys it,
on the real node: the side-by-side benchmark (bench/pod_start.py) measures against it."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from tests.node.support import (
    allocated,
    create_claim,
    delete_pods,
    gpu_request,
    one_claim_pod,
    run_pod,
    wait_report,
)
from tools.node import example_chart
from tools.node.node import RealNode

pytestmark = pytest.mark.integration


def test_reference_plugin_from_its_chart_runs_a_gpu_pod(
    api: Any, namespace: str, real_node: RealNode
) -> None:
    """The chart's DaemonSet pod registers gpu.example.com with the kubelet and publishes
    its slices; a pod with a claim of its DeviceClass (the chart's own) reaches Running with
    the env the plugin's CDI spec, written through the node's CDI folder, gives it."""
    objects = example_chart.install(real_node)
    try:
        pod = example_chart.wait_serving(real_node)
        assert pod.spec.priority_class_name == "system-node-critical"
        assert pod.spec.containers[0].security_context.privileged
        client.ResourceV1Api(api).read_device_class(example_chart.DRIVER)

        create_claim(
            api, namespace, "ex", {"requests": [gpu_request(device_class=example_chart.DRIVER)]}
        )
        run_pod(api, namespace, one_claim_pod(real_node, "ex", "ex"))
        (device,) = allocated(api, namespace, "ex")
        assert device.driver == example_chart.DRIVER
        rep = wait_report(real_node, namespace, "ex")
        # The reference plugin's CDI spec sets one variable per device it hands out.
        assert device.device in rep.env.values(), rep.env
        delete_pods(api, namespace, "ex")
    finally:
        example_chart.uninstall(real_node, objects)
