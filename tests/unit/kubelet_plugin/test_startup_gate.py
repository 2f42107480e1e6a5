"""The sockets are served before the plugin has its GPUs and checkpoint: a prepare that
arrives early waits for start-up to finish and then succeeds (or gets the reason start-up
failed), and a health stream opened early gets the devices once they are known."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from flexgpu.kubelet_plugin.claims.pipeline import ClaimPipeline
from flexgpu.kubelet_plugin.claims.startup_gate import StartupGate
from flexgpu.kubelet_plugin.config import PluginConfig
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef, DeviceHealth, HealthStatus, Server
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra_health.v1 import health_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1 import dra_pb2_grpc
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra_health.v1 import health_pb2_grpc
from tests.unit.kubeletplugin.fakes import MemoryHealth, MemoryPreparer

TIMEOUT = 10
GPU0 = DeviceHealth("node-a", "gpu-0", HealthStatus.HEALTHY, 1_700_000_000)


@pytest.fixture
def gate() -> StartupGate:
    return StartupGate(wait_s=TIMEOUT)


@pytest.fixture
def pipeline(gate: StartupGate) -> ClaimPipeline:
    return ClaimPipeline([gate])  # as the plugin serves it until start-up completes it


@pytest.fixture
def server(
    plugin_config: PluginConfig, gate: StartupGate, pipeline: ClaimPipeline
) -> Iterator[Server]:
    with Server(pipeline, plugin_config.server_options(), gate) as running:
        yield running


def _open(
    gate: StartupGate, pipeline: ClaimPipeline, preparer: MemoryPreparer, health: MemoryHealth
) -> None:
    """What start_node does once start-up is done: the path completed, then the gate opened."""
    pipeline.complete([gate], preparer)
    gate.open(health)


def test_early_prepare_waits_for_start_up_then_succeeds(
    server: Server, gate: StartupGate, pipeline: ClaimPipeline
) -> None:
    preparer = MemoryPreparer()
    claim = dra_pb2.Claim(namespace="ns", name="c", uid="u1")
    with (
        grpc.insecure_channel(f"unix://{server.options.dra_socket}") as channel,
        futures.ThreadPoolExecutor(1) as pool,
    ):
        stub = dra_pb2_grpc.DRAPluginStub(channel)
        call = pool.submit(
            stub.NodePrepareResources,
            dra_pb2.NodePrepareResourcesRequest(claims=[claim]),
            timeout=TIMEOUT,
        )
        # The request is in the server, held by the gate: nothing reached a preparer.
        with pytest.raises(futures.TimeoutError):
            call.result(timeout=0.3)
        assert preparer.calls == []
        _open(gate, pipeline, preparer, MemoryHealth())
        reply = call.result(timeout=TIMEOUT)
    assert reply.claims["u1"].error == ""
    assert [d.device_name for d in reply.claims["u1"].devices] == ["gpu-c"]
    assert preparer.calls == [("prepare", ["u1"])]


def test_failed_start_up_answers_waiting_calls_with_the_reason(
    gate: StartupGate, pipeline: ClaimPipeline
) -> None:
    results: list[object] = []
    waiter = threading.Thread(
        target=lambda: results.append(pipeline.unprepare([ClaimRef("ns", "c", "u1")]))
    )
    waiter.start()
    gate.fail("no GPUs: NVML not found")
    waiter.join(TIMEOUT)
    (result,) = results
    assert "no GPUs: NVML not found" in result["u1"].error  # type: ignore[index]


def test_start_up_that_takes_too_long_is_a_per_claim_error() -> None:
    gate = StartupGate(wait_s=0.05)
    result = ClaimPipeline([gate]).prepare([ClaimRef("ns", "c", "u1")])
    assert "still starting" in (result["u1"].error or "")


def test_health_stream_opened_early_gets_the_devices_once_known(
    server: Server, gate: StartupGate, pipeline: ClaimPipeline
) -> None:
    with grpc.insecure_channel(f"unix://{server.options.dra_socket}") as channel:
        stream = health_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            health_pb2.NodeWatchResourcesRequest(), timeout=TIMEOUT
        )
        first = next(stream)
        assert list(first.devices) == []  # nothing known yet
        _open(gate, pipeline, MemoryPreparer(), MemoryHealth([GPU0]))
        second = next(stream)
        assert [d.device.device_name for d in second.devices] == ["gpu-0"]
        stream.cancel()


def test_plugin_serves_its_sockets_before_start_up_work_runs(
    plugin_config: PluginConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexgpu.kubelet_plugin import main
    from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import (
        registration_pb2,
    )
    from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.pluginregistration.v1 import (
        registration_pb2_grpc,
    )

    seen: dict[str, object] = {}

    def start_node(
        config: PluginConfig, gate: StartupGate, pipeline: ClaimPipeline, readiness: object = None
    ) -> Callable[[], None]:
        # Runs after the sockets are up: the kubelet can already register and call.
        with grpc.insecure_channel(f"unix://{config.registration_socket}") as channel:
            info = registration_pb2_grpc.RegistrationStub(channel).GetInfo(
                registration_pb2.InfoRequest(), timeout=TIMEOUT
            )
        seen["endpoint"] = info.endpoint
        seen["gate_ready"] = gate.ready
        _open(gate, pipeline, MemoryPreparer(), MemoryHealth())
        os.kill(os.getpid(), signal.SIGTERM)  # and the plugin shuts down cleanly
        return lambda: seen.setdefault("stopped", True)

    monkeypatch.setattr(main, "start_node", start_node)
    assert main.run(plugin_config) == 0
    assert seen == {
        "endpoint": str(plugin_config.dra_socket),
        "gate_ready": False,
        "stopped": True,
    }
    assert not plugin_config.dra_socket.exists()


def test_start_up_failure_stops_the_servers_and_exits_1(
    plugin_config: PluginConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexgpu.kubelet_plugin import main

    def start_node(
        config: PluginConfig, gate: StartupGate, pipeline: ClaimPipeline, readiness: object = None
    ) -> Callable[[], None]:
        raise main.StartupFailed("no GPUs: NVML not found")

    monkeypatch.setattr(main, "start_node", start_node)
    assert main.run(plugin_config) == 1
    assert not plugin_config.dra_socket.exists()
    assert not plugin_config.registration_socket.exists()
