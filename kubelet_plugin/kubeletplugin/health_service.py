"""The DRAResourceHealth gRPC service (v1 and v1alpha1 from one implementation).

Each NodeWatchResources stream sends the full device list at once, again whenever the
HealthSource reports a change, and at least every interval so the kubelet never times the
devices out. A stream holds a server thread while it is open, so only max_streams may be open
at once: more would leave no thread for prepares.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import grpc

from flexgpu.kubelet_plugin.kubeletplugin import grpc_handlers as h
from flexgpu.kubelet_plugin.kubeletplugin.health import DeviceHealth, HealthSource
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra_health.v1 import health_pb2 as v1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra_health.v1alpha1 import (
    health_pb2 as v1alpha1,
)

log = logging.getLogger(__name__)


def health_response(pb: ModuleType, devices: Sequence[DeviceHealth]) -> Any:
    """A NodeWatchResourcesResponse of the API version whose generated module is pb."""
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=d.pool_name, device_name=d.device_name),
                health=int(d.status),
                last_updated_time=d.last_updated,
                health_check_timeout_seconds=d.timeout_seconds,
                message=d.message,
            )
            for d in devices
        ]
    )


class HealthService:
    """Implements v1.DRAResourceHealth and v1alpha1.DRAResourceHealth over a HealthSource."""

    def __init__(self, source: HealthSource, interval_seconds: float, max_streams: int = 1) -> None:
        self.source = source
        self.interval_seconds = interval_seconds
        self.max_streams = max_streams
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._wakers: set[threading.Event] = set()

    def start(self) -> None:
        """Allow streams again (after a stop, when the server is restarted)."""
        self._stopping.clear()

    def stop(self) -> None:
        """End all streams now (they would otherwise hold server threads until the interval)."""
        self._stopping.set()
        with self._lock:
            for wake in self._wakers:
                wake.set()

    def watch(self, pb: ModuleType, context: grpc.ServicerContext) -> Iterator[Any]:
        wake = threading.Event()
        with self._lock:
            refused = len(self._wakers) >= self.max_streams
            if not refused:
                self._wakers.add(wake)
        if refused:
            log.warning("health stream refused: %d already open", self.max_streams)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_streams} NodeWatchResources stream(s) may be open at once; "
                "an open one ends when its client disconnects",
            )
        unsubscribe = self.source.subscribe(wake.set)
        # Runs when the RPC ends for any reason (client gone, server stopping).
        context.add_callback(wake.set)
        try:
            while context.is_active() and not self._stopping.is_set():
                wake.clear()  # before the snapshot, so a change during it is not lost
                try:
                    devices = self.source.snapshot()
                except Exception as exc:
                    log.exception("reading device health failed")
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"reading device health: {exc}")
                yield health_response(pb, devices)
                wake.wait(self.interval_seconds)
            if self._stopping.is_set():
                # Tell the kubelet this is not a normal end: it should reconnect.
                context.abort(grpc.StatusCode.UNAVAILABLE, "the plugin is shutting down")
        finally:
            unsubscribe()
            with self._lock:
                self._wakers.discard(wake)

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        result = []
        for pb in (v1, v1alpha1):
            method = h.server_stream(
                self._behaviour(pb), pb.NodeWatchResourcesRequest.FromString, h.serialize
            )
            name = h.service_name(pb.DESCRIPTOR, "DRAResourceHealth")
            result.append(h.service(name, {"NodeWatchResources": method}))
        return result

    def _behaviour(self, pb: ModuleType) -> Any:
        def node_watch_resources(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            return self.watch(pb, context)

        return node_watch_resources
