"""The plugin's gRPC servers over real unix sockets, called with real gRPC clients."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from flexgpu.kubelet_plugin.kubeletplugin import (
    DeviceHealth,
    HealthStatus,
    Options,
    Server,
    ServerError,
    serve,
)
from flexgpu.kubelet_plugin.kubeletplugin.grpc_handlers import MAX_REQUEST_BYTES
from flexgpu.kubelet_plugin.kubeletplugin.probe import probe
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2 as dra_v1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1beta1 import dra_pb2 as dra_v1beta1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra_health.v1 import health_pb2 as health_v1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra_health.v1alpha1 import (
    health_pb2 as health_v1alpha1,
)
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import (
    registration_pb2 as reg,
)
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1 import dra_pb2_grpc as dra_v1_grpc
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1beta1 import (
    dra_pb2_grpc as dra_v1beta1_grpc,
)
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra_health.v1 import (
    health_pb2_grpc as health_v1_grpc,
)
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra_health.v1alpha1 import (
    health_pb2_grpc as health_v1alpha1_grpc,
)
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.pluginregistration.v1 import (
    registration_pb2_grpc as reg_grpc,
)
from flexgpu.kubelet_plugin.kubeletplugin.server import PREPARE_WORKERS
from tests.conftest import wait_for
from tests.unit.kubeletplugin.fakes import MemoryHealth, MemoryPreparer

REPO = Path(__file__).resolve().parents[3]
TIMEOUT = 5

GPU0 = DeviceHealth("node-a", "gpu-0", HealthStatus.HEALTHY, 1_700_000_000)
GPU1 = DeviceHealth("node-a", "gpu-1", HealthStatus.UNHEALTHY, 1_700_000_001, "XID 79", 60)


@pytest.fixture
def preparer() -> MemoryPreparer:
    return MemoryPreparer()


@pytest.fixture
def health() -> MemoryHealth:
    return MemoryHealth([GPU0, GPU1])


@pytest.fixture
def server(options: Options, preparer: MemoryPreparer, health: MemoryHealth) -> Iterator[Server]:
    with Server(preparer, options, health) as running:
        yield running


def _channel(path: Path) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{path}")


@pytest.fixture
def dra_channel(server: Server) -> Iterator[grpc.Channel]:
    with _channel(server.options.dra_socket) as channel:
        yield channel


def test_get_info_and_registration_status(server: Server) -> None:
    with _channel(server.options.registration_socket) as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = stub.GetInfo(reg.InfoRequest(), timeout=TIMEOUT)
        assert info.type == "DRAPlugin"
        assert info.name == "gpu.example.com"
        assert info.endpoint == str(server.options.dra_socket)
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ]
        assert server.registration.state.registered is None

        stub.NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=False, error="version mismatch"),
            timeout=TIMEOUT,
        )
        state = server.registration.state
        assert (state.registered, state.error, state.healthy) == (False, "version mismatch", False)

        stub.NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=True), timeout=TIMEOUT
        )
        assert server.registration.state.healthy


def test_without_health_source_health_is_neither_advertised_nor_served(
    options: Options,
) -> None:
    with Server(MemoryPreparer(), options) as server:
        assert server.registration.versions == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        with _channel(options.dra_socket) as channel:
            stream = health_v1_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health_v1.NodeWatchResourcesRequest(), timeout=TIMEOUT
            )
            with pytest.raises(grpc.RpcError) as info:
                next(iter(stream))
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_prepare_and_unprepare_v1(dra_channel: grpc.Channel, preparer: MemoryPreparer) -> None:
    stub = dra_v1_grpc.DRAPluginStub(dra_channel)
    claims = [
        dra_v1.Claim(namespace="ns", name="train", uid="u1"),
        dra_v1.Claim(namespace="ns", name="shared-infer", uid="u2"),
    ]
    response = stub.NodePrepareResources(
        dra_v1.NodePrepareResourcesRequest(claims=claims), timeout=TIMEOUT
    )
    assert response.claims["u1"].devices[0].device_name == "gpu-train"
    assert response.claims["u2"].devices[0].share_id == "share-u2"
    assert set(preparer.prepared) == {"u1", "u2"}

    unprepared = stub.NodeUnprepareResources(
        dra_v1.NodeUnprepareResourcesRequest(claims=claims), timeout=TIMEOUT
    )
    assert dict(unprepared.claims) == {
        "u1": dra_v1.NodeUnprepareResourceResponse(),
        "u2": dra_v1.NodeUnprepareResourceResponse(),
    }
    assert preparer.prepared == {}


def test_prepare_v1beta1_is_served_by_the_same_implementation(
    dra_channel: grpc.Channel, preparer: MemoryPreparer
) -> None:
    stub = dra_v1beta1_grpc.DRAPluginStub(dra_channel)
    claim = dra_v1beta1.Claim(namespace="ns", name="shared-x", uid="u3")
    response = stub.NodePrepareResources(
        dra_v1beta1.NodePrepareResourcesRequest(claims=[claim]), timeout=TIMEOUT
    )
    (device,) = response.claims["u3"].devices
    assert (device.pool_name, device.device_name) == ("node-a", "gpu-shared-x")
    assert list(device.cdi_device_ids) == ["k8s.gpu.flexgpu.dev/claim=u3"]
    assert "u3" in preparer.prepared
    stub.NodeUnprepareResources(
        dra_v1beta1.NodeUnprepareResourcesRequest(claims=[claim]), timeout=TIMEOUT
    )
    assert preparer.calls == [("prepare", ["u3"]), ("unprepare", ["u3"])]


def test_empty_prepare_request_succeeds(dra_channel: grpc.Channel) -> None:
    for stub_type, pb in ((dra_v1_grpc, dra_v1), (dra_v1beta1_grpc, dra_v1beta1)):
        response = stub_type.DRAPluginStub(dra_channel).NodePrepareResources(
            pb.NodePrepareResourcesRequest(), timeout=TIMEOUT
        )
        assert len(response.claims) == 0


def test_preparer_failure_does_not_break_the_server(
    dra_channel: grpc.Channel, preparer: MemoryPreparer
) -> None:
    stub = dra_v1_grpc.DRAPluginStub(dra_channel)
    request = dra_v1.NodePrepareResourcesRequest(
        claims=[dra_v1.Claim(namespace="ns", name="a", uid="u1")]
    )
    preparer.fail_with = RuntimeError("NVML: GPU is lost")
    response = stub.NodePrepareResources(request, timeout=TIMEOUT)
    assert response.claims["u1"].error == "prepare failed: NVML: GPU is lost"
    preparer.fail_with = None
    assert stub.NodePrepareResources(request, timeout=TIMEOUT).claims["u1"].error == ""


def _watch(channel: grpc.Channel, grpc_module: object, pb: object) -> grpc.Future:
    stub = grpc_module.DRAResourceHealthStub(channel)  # type: ignore[attr-defined]
    return stub.NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=TIMEOUT)  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize(
    ("grpc_module", "pb"),
    [(health_v1_grpc, health_v1), (health_v1alpha1_grpc, health_v1alpha1)],
    ids=["v1", "v1alpha1"],
)
def test_health_stream_sends_full_list_then_changes(
    options: Options, health: MemoryHealth, grpc_module: object, pb: object
) -> None:
    # A long interval, so only a pushed change can arrive within the test's time limit.
    config = dataclasses.replace(options, health_interval_seconds=20.0)
    with Server(MemoryPreparer(), config, health), _channel(config.dra_socket) as channel:
        stream = _watch(channel, grpc_module, pb)
        first = next(stream)
        assert [(d.device.device_name, d.health) for d in first.devices] == [
            ("gpu-0", 1),
            ("gpu-1", 2),
        ]
        assert first.devices[1].message == "XID 79"
        assert first.devices[1].health_check_timeout_seconds == 60
        assert first.devices[1].last_updated_time == 1_700_000_001
        assert first.devices[0].device.pool_name == "node-a"

        health.set([GPU0])
        update = next(stream)
        assert [d.device.device_name for d in update.devices] == ["gpu-0"]
        stream.cancel()


def test_health_stream_repeats_the_full_list_periodically(
    dra_channel: grpc.Channel,
) -> None:
    stream = _watch(dra_channel, health_v1_grpc, health_v1)
    reports = [next(stream) for _ in range(3)]
    assert all(len(r.devices) == 2 for r in reports)
    stream.cancel()


def test_stop_ends_streams_and_removes_sockets(options: Options, health: MemoryHealth) -> None:
    server = Server(MemoryPreparer(), options, health)
    server.start()
    channel = _channel(options.dra_socket)
    stream = _watch(channel, health_v1_grpc, health_v1)
    next(stream)
    assert health.subscriber_count == 1
    started = time.monotonic()
    server.stop(grace=0.5)
    assert time.monotonic() - started < 2
    assert not options.dra_socket.exists()
    assert not options.registration_socket.exists()
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    # The plugin's own "shutting down", or the server's cancellation if that came first.
    assert info.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
    channel.close()
    deadline = time.monotonic() + 2
    while health.subscriber_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health.subscriber_count == 0
    server.stop()  # idempotent

    # The same object can serve again, health streams included.
    with server, _channel(options.dra_socket) as channel:
        assert len(next(_watch(channel, health_v1_grpc, health_v1)).devices) == 2


def test_stale_sockets_are_replaced(options: Options) -> None:
    for path in (options.dra_socket, options.registration_socket):
        path.parent.mkdir(parents=True)
        leftover = socket.socket(socket.AF_UNIX)
        leftover.bind(str(path))
        leftover.close()  # the file stays behind, as after a crash
    with (
        Server(MemoryPreparer(), options),
        _channel(options.registration_socket) as channel,
    ):
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=TIMEOUT)
        assert info.name == "gpu.example.com"


def test_socket_path_that_is_a_directory_is_refused(options: Options) -> None:
    options.dra_socket.mkdir(parents=True)
    with pytest.raises(ServerError, match="is a directory"):
        Server(MemoryPreparer(), options).start()
    assert not options.registration_socket.exists()


def test_second_start_is_refused(server: Server) -> None:
    with pytest.raises(ServerError, match="already running"):
        server.start()


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from flexgpu.kubelet_plugin.kubeletplugin import Options, PrepareResult, Server, UnprepareResult

    class Preparer:
        def prepare(self, claims):
            return {c.uid: PrepareResult() for c in claims}
        def unprepare(self, claims):
            return {c.uid: UnprepareResult() for c in claims}

    root = sys.argv[1]
    options = Options("gpu.example.com", Path(root) / "p" / "gpu.example.com", Path(root) / "r")
    server = Server(Preparer(), options)
    got = server.run_until_signal()
    print("stopped on", got.name, flush=True)
    """
)


def test_sigterm_stops_cleanly(short_tmp: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(short_tmp)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    reg_socket = short_tmp / "r" / "gpu.example.com-reg.sock"
    dra_socket = short_tmp / "p" / "gpu.example.com" / "dra.sock"
    try:
        deadline = time.monotonic() + 10
        while not reg_socket.exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "plugin did not start"
            time.sleep(0.02)
        with _channel(dra_socket) as channel:
            stub = dra_v1_grpc.DRAPluginStub(channel)
            stub.NodePrepareResources(dra_v1.NodePrepareResourcesRequest(), timeout=TIMEOUT)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert "stopped on SIGTERM" in out
    assert not reg_socket.exists() and not dra_socket.exists()


def test_concurrent_prepares_are_served_in_parallel(
    options: Options,
) -> None:
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    class Waiting(MemoryPreparer):
        def prepare(self, claims):  # type: ignore[no-untyped-def]
            barrier.wait()  # only returns once both calls are inside at the same time
            return super().prepare(claims)

    with Server(Waiting(), options), _channel(options.dra_socket) as channel:
        stub = dra_v1_grpc.DRAPluginStub(channel)
        futures = [
            stub.NodePrepareResources.future(
                dra_v1.NodePrepareResourcesRequest(
                    claims=[dra_v1.Claim(namespace="ns", name=n, uid=n)]
                ),
                timeout=TIMEOUT,
            )
            for n in ("a", "b")
        ]
        assert [f.result().claims[n].error for f, n in zip(futures, "ab", strict=True)] == [
            "",
            "",
        ]


def test_liveness_probe_answers_only_while_the_plugin_serves(options: Options) -> None:
    assert probe(options.registration_socket, timeout=1) is not None  # nothing listening yet
    with serve(MemoryPreparer(), options):
        assert probe(options.registration_socket) is None
    assert "not answering" in str(probe(options.registration_socket, timeout=1))


def test_rolling_update_instances_serve_side_by_side(options: Options) -> None:
    """Two instances with different pod UIDs (old and new pod of a rolling update) each have
    their own sockets, and stopping the old one leaves the new one's in place."""
    old = dataclasses.replace(options, pod_uid="0b1e5f0a-old")
    new = dataclasses.replace(options, pod_uid="6c7d8e9f-new")
    assert old.dra_socket != new.dra_socket
    assert old.registration_socket != new.registration_socket
    with serve(MemoryPreparer(), new):
        with serve(MemoryPreparer(), old):
            assert probe(old.registration_socket) is None
            assert probe(new.registration_socket) is None
        assert not old.dra_socket.exists() and not old.registration_socket.exists()
        assert probe(new.registration_socket) is None


def test_oversized_request_is_refused_and_the_server_goes_on(
    dra_channel: grpc.Channel, preparer: MemoryPreparer
) -> None:
    """A request over 4 MiB (what gRPC servers accept by default) is refused by the transport
    before it is parsed, naming the limit; the next call on the same channel is served."""
    stub = dra_v1_grpc.DRAPluginStub(dra_channel)
    huge = dra_v1.Claim(namespace="ns", name="x" * (MAX_REQUEST_BYTES + 1), uid="u-huge")
    with pytest.raises(grpc.RpcError) as info:
        stub.NodePrepareResources(
            dra_v1.NodePrepareResourcesRequest(claims=[huge]), timeout=TIMEOUT
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {MAX_REQUEST_BYTES})" in str(info.value.details())
    assert preparer.calls == []
    small = dra_v1.Claim(namespace="ns", name="ok", uid="u-ok")
    response = stub.NodePrepareResources(
        dra_v1.NodePrepareResourcesRequest(claims=[small]), timeout=TIMEOUT
    )
    assert response.claims["u-ok"].error == ""


def test_a_stream_does_not_hold_a_worker(options: Options, health: MemoryHealth) -> None:
    """More open health streams than worker threads: prepares are still served (streams wait
    on the event loop, unary calls on the workers)."""
    with Server(MemoryPreparer(), options, health), _channel(options.dra_socket) as channel:
        streams = [_watch(channel, health_v1_grpc, health_v1) for _ in range(PREPARE_WORKERS + 2)]
        for stream in streams:
            next(stream)
        stub = dra_v1_grpc.DRAPluginStub(channel)
        claim = dra_v1.Claim(namespace="ns", name="a", uid="u-a")
        response = stub.NodePrepareResources(
            dra_v1.NodePrepareResourcesRequest(claims=[claim]), timeout=TIMEOUT
        )
        assert response.claims["u-a"].error == ""
        for stream in streams:
            stream.cancel()


class _Held(MemoryPreparer):
    """A preparer whose prepare waits until released, to have a call in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def prepare(self, claims):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return super().prepare(claims)


def _held_call(channel: grpc.Channel) -> grpc.Future:
    return dra_v1_grpc.DRAPluginStub(channel).NodePrepareResources.future(  # type: ignore[no-any-return]
        dra_v1.NodePrepareResourcesRequest(
            claims=[dra_v1.Claim(namespace="ns", name="a", uid="u")]
        ),
        timeout=TIMEOUT,
    )


def test_stop_lets_an_in_flight_prepare_finish_within_the_grace_period(options: Options) -> None:
    preparer = _Held()
    server = Server(preparer, options)
    server.start()
    with _channel(options.dra_socket) as channel:
        call = _held_call(channel)
        assert preparer.entered.wait(TIMEOUT)
        stopping = threading.Thread(target=server.stop, kwargs={"grace": 3.0})
        stopping.start()
        # Released only once the server is stopping: its socket is gone, nobody new connects.
        wait_for(lambda: not options.dra_socket.exists(), timeout_s=TIMEOUT, what="stop begun")
        preparer.release.set()
        assert call.result(TIMEOUT).claims["u"].error == ""
        stopping.join(TIMEOUT)
        assert not stopping.is_alive()
    assert not options.dra_socket.exists()


def test_stop_cancels_a_call_still_running_after_the_grace_period(options: Options) -> None:
    preparer = _Held()
    server = Server(preparer, options)
    server.start()
    try:
        with _channel(options.dra_socket) as channel:
            call = _held_call(channel)
            assert preparer.entered.wait(TIMEOUT)
            started = time.monotonic()
            server.stop(grace=0.3)
            assert time.monotonic() - started < 3
            with pytest.raises(grpc.RpcError):
                call.result(TIMEOUT)
    finally:
        preparer.release.set()
