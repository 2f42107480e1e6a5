"""A plugin (re)started while the API server is away, MPS daemon pods on: start-up finishes
instead of failing (no crash loop), a claim prepared before is prepared again and unprepared
from local state, and the watches catch up once the server answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys, time, json, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from fake_kube_api import FakeKubeApi
    from flexgpu.kubelet_plugin import main, node_parts
    from flexgpu.kubelet_plugin.claims.claim_source import claim_path
    from flexgpu.kubelet_plugin.config import make_config
    from flexgpu.kubelet_plugin.api.kube_api import KubeApi
    from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
    from flexgpu.kubelet_plugin.claims.pipeline import ClaimPipeline
    from flexgpu.kubelet_plugin.claims.startup_gate import StartupGate

    root = Path({root!r})
    config = make_config(
        node_name="node-a", registry_dir=root / "registry", plugins_dir=root / "plugins",
        cdi_dir=root / "cdi", data_dir=root / "data", health_interval_seconds=0.2,
        gpu_backend="simulated", topology="l4-2-pcie", driver_root=root / "driver",
        mps_namespace="flexgpu", mps_image="img",
    )
    (root / "driver").mkdir(exist_ok=True)
    node_parts.node_driver_edits = lambda config, devices: {{}}  # no driver libraries here
    claim = ClaimRef("ns", "c", "u1")

    # 1: API server up (in memory): the claim is prepared.
    fake = FakeKubeApi()
    fake.close = lambda: None
    fake.lists["/api/v1/namespaces/flexgpu/pods"] = []
    fake.put_object(claim_path("ns", "c"), {{
        "metadata": {{"name": "c", "namespace": "ns", "uid": "u1"}},
        "status": {{"allocation": {{"devices": {{"results": [{{
            "request": "gpu", "driver": "gpu.flexgpu.dev", "pool": "node-a", "device": "gpu-0",
        }}]}}}}}},
    }})
    node_parts.make_api = lambda config: fake
    gate = StartupGate(wait_s=30)
    pipeline = ClaimPipeline([gate])
    stop = main.start_node(config, gate, pipeline)
    first = pipeline.prepare([claim])["u1"]
    print("first", first.error or [d.device_name for d in first.devices])
    stop()

    # 2: restarted with the API server away (nothing listens on the port).
    api = KubeApi("http://127.0.0.1:{port}")
    node_parts.make_api = lambda config: api
    gate = StartupGate(wait_s=30)
    pipeline = ClaimPipeline([gate])
    started = time.monotonic()
    stop = main.start_node(config, gate, pipeline)
    print("started in", round(time.monotonic() - started, 1))
    again = pipeline.prepare([claim])["u1"]
    print("again", again.error or [d.device_name for d in again.devices])
    print("unprepared", repr(pipeline.unprepare([claim])["u1"].error))

    # 3: the API server comes back: the MPS daemon pods' watch lists them.
    class Up(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def do_GET(self):
            body = json.dumps({{"metadata": {{"resourceVersion": "1"}}, "items": []}}).encode()
            if "watch=1" in self.path:
                time.sleep(0.5)
                body = b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_POST = do_PUT = do_PATCH = do_GET
    httpd = ThreadingHTTPServer(("127.0.0.1", {port}), Up)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    copy = pipeline.end.mps._pods_copy  # the preparer, at the end of the claim pipeline
    deadline = time.monotonic() + 40
    while not copy.synced and time.monotonic() < deadline:
        time.sleep(0.1)
    print("pods synced", copy.synced)
    stop()
    httpd.shutdown()
    """
)


def test_start_up_with_the_api_server_down_serves_from_local_state(short_tmp: Path) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    tests = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=tests, root=str(short_tmp), port=port)],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "first ['gpu-0']" in lines, out.stdout
    assert "again ['gpu-0']" in lines, out.stdout + out.stderr[-3000:]
    assert "unprepared ''" in lines, out.stdout
    started = next(line for line in lines if line.startswith("started in"))
    assert float(started.split()[-1]) < 30, started  # no wait on the API server
    assert "pods synced True" in lines, out.stdout + out.stderr[-2000:]
