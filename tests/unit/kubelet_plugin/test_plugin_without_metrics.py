"""A plugin without a metrics port starts without prometheus_client (memory, issue #11)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from fake_kube_api import FakeKubeApi
    from flexgpu.kubelet_plugin import main, node_parts
    from flexgpu.kubelet_plugin.config import make_config
    from flexgpu.kubelet_plugin.claims.pipeline import ClaimPipeline
    from flexgpu.kubelet_plugin.claims.startup_gate import StartupGate

    root = Path({root!r})
    config = make_config(
        node_name="node-a", registry_dir=root / "registry", plugins_dir=root / "plugins",
        cdi_dir=root / "cdi", data_dir=root / "data", health_interval_seconds=0.2,
        gpu_backend="simulated", topology="l4-2-pcie",
    )
    api = FakeKubeApi()
    api.close = lambda: None  # the fake holds no connection
    node_parts.make_api = lambda config: api
    gate = StartupGate()
    pipeline = ClaimPipeline([gate])
    stop = main.start_node(config, gate, pipeline)
    try:
        print("served", " > ".join(pipeline.names))  # the stages in order, then the preparer
        print("prometheus", "prometheus_client" in sys.modules)
    finally:
        stop()
    """
)


def _run(root: Path, env: dict[str, str]) -> str:
    tests = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=tests, root=str(root))],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("port", ["", "0"])
def test_no_metrics_port_means_no_prometheus_and_no_metrics_stage(
    short_tmp: Path, port: str
) -> None:
    out = _run(short_tmp, {"FLEXGPU_METRICS_PORT": port})
    assert "served start-up gate > tenancy > ClaimPreparerImpl\n" in out
    assert "prometheus False" in out


def test_with_a_metrics_port_prepares_are_counted(short_tmp: Path) -> None:
    with socket.socket() as probe:  # a free port for the endpoint
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = {"FLEXGPU_METRICS_PORT": port, "FLEXGPU_METRICS_ADDRESS": "127.0.0.1"}
    out = _run(short_tmp, env)
    assert "served start-up gate > metrics > tenancy > ClaimPreparerImpl\n" in out
    assert "prometheus True" in out
