"""A local OCI image registry (tools/registry/build.sh builds it from distribution's module)
serving plain HTTP on a free loopback port, its blobs in a folder of its own. The real-node
tests push the flexgpu image to it and the node's containerd pulls from it, as a cluster pulls
a released image."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

from tools import buildcache
from tools.cluster.control_plane import free_port
from tools.cluster.process import Component

PROGRAM = "flexgpu-registry"


class RegistryError(RuntimeError):
    pass


def registry_binary() -> Path:
    """The registry program, built (or found in the tool cache) by build.sh."""
    try:
        return buildcache.path("registry", timeout=1800) / PROGRAM
    except buildcache.BuildError as e:
        raise RegistryError(str(e)) from e


def config_text(storage: Path, port: int) -> str:
    """distribution's configuration: filesystem storage, loopback only, deletes allowed (the
    tests may drop what they pushed), no tracing exporter."""
    return f"""version: 0.1
log:
  level: warn
  formatter: text
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


class LocalRegistry:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self.process: Component | None = None

    @property
    def address(self) -> str:
        """host:port as image references name it ("" until it started)."""
        return f"127.0.0.1:{self.port}" if self.port else ""

    def start(self, timeout_s: float = 30.0) -> None:
        binary = registry_binary()
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = self.root / "config.yml"
        config.write_text(config_text(self.root / "storage", self.port))
        self.process = Component(
            f"registry[{self.address}]",
            [str(binary), "serve", str(config)],
            self.root / "registry.log",
            # OpenTelemetry's exporter would otherwise try to reach a collector.
            env={
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_SDK_DISABLED": "true",
                "PATH": "/usr/bin:/bin",
            },
        )
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.running():
                break
            if self.serving():
                return
            time.sleep(0.2)
        tail = self.process.log_tail()
        self.stop()
        raise RegistryError(f"the local registry did not serve on {self.address}:\n{tail}")

    def serving(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
