"""The two kubelet plugins under comparison: how each is started, where its DRA socket is, and
how long it takes from exec to serving that socket and to its ResourceSlices existing."""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import urllib3
import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from bench.claims import BenchClaim
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1 import dra_pb2_grpc
from tools import buildcache
from tools.cluster.process import Component

REPO = Path(__file__).resolve().parent.parent
DEVICES = 8
START_TIMEOUT_S = 60.0
# The bench's node: eight whole H100s. hgx-h100-8 starts GPUs 6 and 7 in MIG mode, which
# flexgpu publishes as MIG devices only (what a GPU already is is adopted), so the bench runs
# on a copy of it with MIG off everywhere (whole_gpu_topology).
TOPOLOGY = "hgx-h100-8"


@dataclass(frozen=True)
class PluginSpec:
    label: str
    driver: str  # DRA driver name, also the ResourceSlice spec.driver
    device_class: str  # written into the bench claims' requests
    identity: str  # ServiceAccount and FlowSchema name
    argv: tuple[str, ...]
    socket: Path
    kubelet_dirs: tuple[Path, ...]  # made before exec, as the kubelet has them on a node
    env: dict[str, str] | None = None


def whole_gpu_topology(root: Path) -> Path:
    """A copy of TOPOLOGY with every GPU out of MIG mode, written under ``root``; fails,
    naming the topology, when it has fewer than DEVICES GPUs."""
    source = REPO / "driver" / "topologies" / f"{TOPOLOGY}.yaml"
    doc = yaml.safe_load(source.read_text())
    gpus = doc.get("gpus") or []
    if len(gpus) < DEVICES:
        raise StartFailed(f"topology {TOPOLOGY} has {len(gpus)} GPUs; the bench needs {DEVICES}")
    for gpu in gpus:
        gpu.pop("migEnabled", None)
    doc["name"] = f"{TOPOLOGY}-whole"
    path = root / f"{TOPOLOGY}-whole.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def flexgpu_spec(root: Path, kubeconfig: Path, node: str, cdi_root: Path) -> PluginSpec:
    return PluginSpec(
        label="flexgpu",
        driver="gpu.flexgpu.dev",
        device_class="gpu.flexgpu.dev",
        identity="flexgpu-plugin",
        argv=(
            sys.executable,
            "-m",
            "flexgpu.kubelet_plugin.main",
            "--gpu-backend=simulated",
            f"--topology={whole_gpu_topology(root)}",
            f"--node-name={node}",
            f"--kubeconfig={kubeconfig}",
            f"--registry-dir={root}/reg",
            f"--plugins-dir={root}/plugins",
            f"--cdi-dir={cdi_root}",
            f"--data-dir={root}/data",
            # As the reference plugin below: the driver is measured, not its rate limiter.
            "--kube-api-qps=1000",
            "--kube-api-burst=1000",
        ),
        socket=root / "plugins" / "gpu.flexgpu.dev" / "dra.sock",
        kubelet_dirs=(root / "reg", root / "plugins"),
    )


def example_binary() -> Path:
    """Builds the reference driver's kubelet plugin (or finds it cached); its path."""
    return buildcache.path("example-driver", stream=True) / "dra-example-kubeletplugin"


def example_spec(
    binary: Path, root: Path, kubeconfig: Path, node: str, cdi_root: Path
) -> PluginSpec:
    return PluginSpec(
        label="example",
        driver="gpu.example.com",
        device_class="gpu.example.com",
        identity="example-plugin",
        argv=(
            str(binary),
            f"--node-name={node}",
            f"--num-devices={DEVICES}",
            f"--cdi-root={cdi_root}",
            f"--kubelet-registrar-directory-path={root}/reg",
            f"--kubelet-plugins-directory-path={root}/plugins",
            f"--kubeconfig={kubeconfig}",
            # client-go's default (5 qps, burst 10) would throttle its claim reads: measure
            # the driver, not the limiter.
            "--kube-api-qps=1000",
            "--kube-api-burst=1000",
        ),
        socket=root / "plugins" / "gpu.example.com" / "dra.sock",
        kubelet_dirs=(root / "reg", root / "plugins"),
        # Its flags also read environment variables (KUBECONFIG, NODE_NAME, V, ...): none leak in.
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())},
    )


class StartFailed(RuntimeError):
    """The plugin exited, or did not serve its DRA socket, within the start-up timeout."""


@dataclass
class StartTimes:
    to_socket_s: float  # exec -> DRA socket answers an empty NodePrepareResources
    to_slices_s: float  # exec -> ResourceSlices list gpu-0..gpu-7 of this node (NaN: never)
    to_prepared_s: float  # exec -> a real claim prepared (retried until it is; NaN: never)


class SliceWatch:
    """Notes when this driver's slices for the node first hold all of gpu-0..gpu-(N-1)."""

    def __init__(self, api: Any, spec: PluginSpec, node: str) -> None:
        self._api = api
        self._selector = f"spec.driver={spec.driver},spec.nodeName={node}"
        self._wanted = {f"gpu-{i}" for i in range(DEVICES)}
        self.seen_at: float | None = None
        # The devices the node's slices held last: what a failure reports.
        self.last_seen: set[str] = set()
        self._stopped = False
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._follow()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as err:
            # Stopped early (the plugin did not start) or the stream broke: nothing seen.
            if self.seen_at is None and not self._stopped:
                print(f"slice watch ({self._selector}) ended: {err}", flush=True)

    def _follow(self) -> None:
        resource: Any = client.ResourceV1Api(self._api)
        devices: dict[str, set[str]] = {}
        for event in self._watch.stream(
            resource.list_resource_slice,
            field_selector=self._selector,
            timeout_seconds=int(START_TIMEOUT_S),
        ):
            obj = event["object"]
            name = obj.metadata.name
            if event["type"] == "DELETED":
                devices.pop(name, None)
            else:
                devices[name] = {d.name for d in (obj.spec.devices or [])}
            self.last_seen = set().union(*devices.values())
            if self._wanted <= self.last_seen:
                self.seen_at = time.perf_counter()
                self._watch.stop()
                return

    @property
    def wanted(self) -> set[str]:
        return set(self._wanted)

    def wait(self, timeout_s: float) -> float | None:
        self._thread.join(timeout_s)
        self.stop()
        return self.seen_at

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


def delete_slices(api: Any, spec: PluginSpec, node: str) -> None:
    """Removes the driver's slices for the node and waits until none is left."""
    resource: Any = client.ResourceV1Api(api)
    selector = f"spec.driver={spec.driver},spec.nodeName={node}"
    resource.delete_collection_resource_slice(field_selector=selector)
    deadline = time.monotonic() + 30
    while resource.list_resource_slice(field_selector=selector).items:
        if time.monotonic() > deadline:
            raise RuntimeError(f"slices of {spec.driver} on {node} still listed after 30 s")
        time.sleep(0.05)


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


class RunningPlugin:
    """One plugin process plus a DRA connection to it."""

    def __init__(self, spec: PluginSpec, log: Path) -> None:
        self.spec = spec
        self.component = Component(spec.label, spec.argv, log, env=spec.env)
        self.channel: grpc.Channel | None = None
        self.stub: dra_pb2_grpc.DRAPluginStub | None = None

    @property
    def pid(self) -> int:
        assert self.component.pid is not None
        return self.component.pid

    def start(self, api: Any, node: str, probe: BenchClaim) -> StartTimes:
        """Execs the plugin with none of its slices in the API; returns the start-up times.
        `probe` is prepared (and unprepared) as soon as the socket serves, retried until it
        succeeds: a plugin may serve before it is ready to prepare."""
        delete_slices(api, self.spec, node)
        for folder in self.spec.kubelet_dirs:
            folder.mkdir(parents=True, exist_ok=True)
        self.spec.socket.unlink(missing_ok=True)
        slices = SliceWatch(api, self.spec, node)
        slices.start()
        began = time.perf_counter()
        self.component.start()
        try:
            serving = self._wait_serving()
        except StartFailed:
            slices.stop()
            raise
        prepared = self._first_prepare(probe, began + START_TIMEOUT_S)
        listed = slices.wait(max(1.0, START_TIMEOUT_S - (time.perf_counter() - began)))
        if listed is None:
            # The bench measures a node of DEVICES whole GPUs: a topology or plugin that no
            # longer publishes them is a broken bench, not a slow start.
            seen = sorted(slices.last_seen)
            missing = sorted(slices.wanted - slices.last_seen)
            raise StartFailed(
                f"{self.spec.label}: slices with gpu-0..gpu-{DEVICES - 1} not listed within "
                f"{START_TIMEOUT_S:.0f}s of exec (missing {missing}; listed {seen[:12]}); "
                f"log {self.component.log_path}"
            )
        return StartTimes(
            serving - began,
            math.nan if listed is None else listed - began,
            math.nan if prepared is None else prepared - began,
        )

    def _first_prepare(self, probe: BenchClaim, until: float) -> float | None:
        assert self.stub is not None
        ref = dra_pb2.Claim(namespace=probe.namespace, name=probe.name, uid=probe.uid)
        while time.perf_counter() < until:
            try:
                reply = self.stub.NodePrepareResources(
                    dra_pb2.NodePrepareResourcesRequest(claims=[ref]), timeout=10
                )
                entry = reply.claims.get(probe.uid)
                ok = entry is not None and not entry.error
            except grpc.RpcError:
                ok = False
            if ok:
                done = time.perf_counter()
                self.stub.NodeUnprepareResources(
                    dra_pb2.NodeUnprepareResourcesRequest(claims=[ref]), timeout=10
                )
                return done
            time.sleep(0.01)
        return None

    def _wait_serving(self) -> float:
        """Waits for the DRA socket to answer an empty prepare; the time it did."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _accepts(self.spec.socket):
            if not self.component.running():
                raise StartFailed(
                    f"{self.spec.label} plugin exited with code {self.component.exit_code()}; "
                    f"log {self.component.log_path}:\n{self.component.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StartFailed(f"{self.spec.label}: no DRA socket after {START_TIMEOUT_S}s")
            time.sleep(0.002)
        self.channel = grpc.insecure_channel(f"unix://{self.spec.socket}")
        self.stub = dra_pb2_grpc.DRAPluginStub(self.channel)
        try:
            self.stub.NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=[]),
                timeout=max(1.0, deadline - time.monotonic()),
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            raise StartFailed(
                f"{self.spec.label}: empty NodePrepareResources failed: "
                f"{exc.code().name} {exc.details()}; log {self.component.log_path}"
            ) from None
        return time.perf_counter()

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
            self.stub = None
        self.component.stop()
