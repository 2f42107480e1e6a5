"""The DRAResourceHealth gRPC service (v1 and v1alpha1 from one implementation).

Each NodeWatchResources stream sends the full device list at once, again whenever the
HealthSource reports a change, and at least every interval so the kubelet never times the
devices out. Streams live on the server's event loop, so an open stream holds no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
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


def _thread_safe_setter(event: asyncio.Event) -> Callable[[], None]:
    """A function any thread may call to set `event` on the loop running now."""
    loop = asyncio.get_running_loop()

    def wake() -> None:
        # A closed loop refuses the call: its stream is gone already.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(event.set)

    return wake


class HealthService:
    """Implements v1.DRAResourceHealth and v1alpha1.DRAResourceHealth over a HealthSource."""

    def __init__(self, source: HealthSource, interval_seconds: float) -> None:
        self.source = source
        self.interval_seconds = interval_seconds
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._wakers: set[Callable[[], None]] = set()

    def start(self) -> None:
        """Allow streams again (after a stop, when the server is restarted)."""
        self._stopping.clear()

    def stop(self) -> None:
        """End all streams now (they would otherwise wait out their interval)."""
        self._stopping.set()
        with self._lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    async def watch(
        self, pb: ModuleType, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        changed = asyncio.Event()
        wake = _thread_safe_setter(changed)
        with self._lock:
            self._wakers.add(wake)
        unsubscribe = self.source.subscribe(wake)
        # A client that goes away cancels this generator at its next await; finally cleans up.
        try:
            while not self._stopping.is_set():
                changed.clear()  # before the snapshot, so a change during it is not lost
                try:
                    devices = self.source.snapshot()
                except Exception as exc:
                    log.exception("reading device health failed")
                    problem = f"reading device health: {exc}"
                else:
                    problem = ""
                if problem:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, problem)
                yield health_response(pb, devices)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self.interval_seconds)
            # Tell the kubelet this is not a normal end: it should reconnect.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the plugin is shutting down")
        finally:
            unsubscribe()
            with self._lock:
                self._wakers.discard(wake)

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        result = []
        for pb in (v1, v1alpha1):
            method = h.server_stream(self._behaviour(pb), pb.NodeWatchResourcesRequest.FromString)
            name = h.service_name(pb.DESCRIPTOR, "DRAResourceHealth")
            result.append(h.service(name, {"NodeWatchResources": method}))
        return result

    def _behaviour(self, pb: ModuleType) -> h.StreamMethod:
        # An async generator function itself: grpc.aio runs any other kind of stream handler
        # on a worker thread, which an open stream would then hold.
        async def node_watch_resources(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            async for reply in self.watch(pb, context):
                yield reply

        return node_watch_resources
