"""Where the real node's flexgpu image comes from: a local OCI registry (tools/registry) that
the image is pushed to as the release pushes it, and that the node's containerd pulls from
through the chart's own image values, as a cluster pulls a released image. The registry
listens on this machine's loopback; a forwarder makes the same address answer inside the
node's network namespace, so the reference pushed is the reference the pod names."""

from __future__ import annotations

import sys
import time

from release.layers import BuiltImage
from release.push import push
from tools.cluster.process import Component
from tools.node import configs
from tools.registry.server import LocalRegistry

# The flexgpu image's repository in the local registry (the chart's image.repository).
REPOSITORY = "flexgpu/flexgpu"


class ImageSource:
    def __init__(self, layout: configs.NodeLayout, node_name: str) -> None:
        self.layout = layout
        self.node_name = node_name
        self.registry = LocalRegistry(layout.registry_root)
        self.forwarder: Component | None = None

    @property
    def address(self) -> str:
        return self.registry.address

    def start(self) -> None:
        """Starts the registry and writes containerd's host settings for it (before
        containerd starts: it reads them per pull, but the folder must exist)."""
        self.registry.start()
        hosts = self.layout.registry_hosts_dir / self.address
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(configs.registry_hosts_toml(self.address))

    def forward_into(self, holder_pid: int, timeout_s: float = 30.0) -> None:
        """Makes the registry's address answer inside the node's network namespace."""
        self.forwarder = Component(
            f"registry-forwarder[{self.node_name}]",
            [
                sys.executable,
                "-m",
                "tools.node.forward",
                str(holder_pid),
                "127.0.0.1",
                str(self.registry.port),
                "127.0.0.1",
                str(self.registry.port),
            ],
            self.layout.logs / "registry-forwarder.log",
        )
        self.forwarder.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.forwarder.running():
            if "forwarding" in self.forwarder.log_tail(5):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"the registry forwarder of node {self.node_name} did not start:\n"
            f"{self.forwarder.log_tail()}"
        )

    def push(self, image: BuiltImage, tag: str | None = None) -> str:
        """Pushes ``image``'s archive under ``tag`` (default: its own); returns the
        reference by digest, ``<registry>/flexgpu/flexgpu@sha256:...``."""
        tag = tag or image.name.rpartition(":")[2]
        return push(str(image.archive), f"{self.address}/{REPOSITORY}:{tag}", plain_http=True)

    def stop(self) -> None:
        if self.forwarder is not None:
            self.forwarder.stop()
        self.registry.stop()
