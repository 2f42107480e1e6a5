"""The reference driver's chart as the pod-start bench applies it: the upstream chart's own
output, with the image and kubelet folders set and nothing changed but the CDI hostPath."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from release.layers import BuiltImage
from tools.node import example_chart

IMAGE = BuiltImage("local.flexgpu.dev/dra-example-driver:v0.4.0-abc", Path("/nonexistent"))


def _node(root: Path) -> Any:
    return SimpleNamespace(
        cluster=SimpleNamespace(kubeconfig=Path("/dev/null")),
        layout=SimpleNamespace(kubelet_dir=root / "kubelet", cdi_dir=root / "cdi"),
    )


def _daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    return ds


def test_only_the_cdi_host_path_differs_from_the_charts_output(tmp_path: Path) -> None:
    node = _node(tmp_path)
    applied = example_chart.render(node, IMAGE)
    plain = [
        o
        for o in yaml.safe_load_all(
            example_chart.helm(
                Path("/dev/null"),
                "template",
                example_chart.RELEASE,
                str(example_chart.chart_dir()),
                "--namespace",
                example_chart.NAMESPACE,
                "--set-string",
                "image.repository=local.flexgpu.dev/dra-example-driver,image.tag=v0.4.0-abc",
                "--set-string",
                "image.pullPolicy=Never",
                "--set-string",
                f"kubeletPlugin.kubeletRegistrarDirectoryPath={tmp_path}/kubelet/plugins_registry",
                "--set-string",
                f"kubeletPlugin.kubeletPluginsDirectoryPath={tmp_path}/kubelet/plugins",
            )
        )
        if o
    ]
    expected = copy.deepcopy(plain)
    for volume in _daemonset(expected)["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "cdi":
            assert volume["hostPath"]["path"] == "/var/run/cdi"
            volume["hostPath"]["path"] = str(tmp_path / "cdi")
    assert applied == expected
    assert applied != plain

    spec = _daemonset(applied)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["image"] == IMAGE.name
    assert container["command"] == ["dra-example-kubeletplugin"]
    # The chart's own defaults stay: no resources, privileged, its priority class.
    assert container["resources"] == {}
    assert container["securityContext"] == {"privileged": True}
    assert spec["priorityClassName"] == "system-node-critical"
    assert {o["kind"] for o in applied} >= {"DeviceClass", "ServiceAccount", "ClusterRole"}
