"""Lifecycle of a DRA plugin's two gRPC servers on unix sockets.

The DRA server (DRAPlugin v1/v1beta1 and, with a HealthSource, DRAResourceHealth v1/v1alpha1)
listens on the DRA socket; the registration server listens in the kubelet's plugin registry
directory, where its appearance is what makes the kubelet call us. DRA starts first so it is
ready when the kubelet follows the registration; on stop, registration goes first.

The servers are grpcio's asyncio servers (grpc.aio: gRPC's C core) on one event loop of their
own thread; prepare, checkpoints, file locks and device libraries are blocking calls, so each
unary call runs on a worker thread of the server's pool and health streams wait on the loop,
holding no thread. The C core enforces the request size limit as messages arrive and its
HTTP/2 keeps up with the kubelet's Go client; it costs about 10 MiB more than a pure-Python
server, which a GPU node does not notice (docs/kubelet-plugin.md, "Measured").
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

import grpc

from flexgpu.kubelet_plugin.kubeletplugin import grpc_handlers as h
from flexgpu.kubelet_plugin.kubeletplugin.claims import DraDriver
from flexgpu.kubelet_plugin.kubeletplugin.dra_service import DRAService
from flexgpu.kubelet_plugin.kubeletplugin.health import HealthSource
from flexgpu.kubelet_plugin.kubeletplugin.health_service import HealthService
from flexgpu.kubelet_plugin.kubeletplugin.registration import (
    RegistrationService,
    supported_versions,
)
from flexgpu.kubelet_plugin.kubeletplugin.sockets import (
    ServerError,
    dra_socket_path,
    registration_socket_path,
    remove_stale_socket,
)

log = logging.getLogger(__name__)

# Threads for blocking unary calls (health streams wait on the event loop and need none).
# The work holds the GIL most of the time: measured side by side, 4 threads served 8
# concurrent callers faster than 8 threads, with less memory. Calls beyond this wait in the
# pool's queue; none fails.
PREPARE_WORKERS = 4
REGISTRATION_WORKERS = 2
# How long stop() waits beyond the grace period for the servers' own shutdown.
CLOSE_TIMEOUT_S = 2.0
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", h.MAX_REQUEST_BYTES),
    # A unix socket of our own: no other process may share it.
    ("grpc.so_reuseport", 0),
]

T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    """Where and as whom a DRA driver is served (upstream kubeletplugin's options).

    plugin_data_dir: the driver's directory under the kubelet's plugins dir
    (/var/lib/kubelet/plugins/<driver>), where the DRA socket goes. registrar_dir: the
    kubelet's plugin registry (/var/lib/kubelet/plugins_registry). pod_uid: set when
    instances of the plugin may overlap in a rolling update; each then has its own sockets.
    health_interval_seconds: how often health streams resend the full list (the kubelet
    times devices out after 30 s without a report).
    """

    driver_name: str
    plugin_data_dir: Path
    registrar_dir: Path
    pod_uid: str | None = None
    health_interval_seconds: float = 10.0

    @property
    def dra_socket(self) -> Path:
        return dra_socket_path(self.plugin_data_dir, self.pod_uid)

    @property
    def registration_socket(self) -> Path:
        return registration_socket_path(self.registrar_dir, self.driver_name, self.pod_uid)


@dataclass
class _Listener:
    name: str
    path: Path
    server: grpc.aio.Server
    pool: futures.ThreadPoolExecutor


class _EventLoop:
    """An asyncio loop running on a daemon thread of its own, for the gRPC servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="grpc-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs coroutine on the loop and waits for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class Server:
    """Serves registration and DRA for one plugin process.

    Usage: `with Server(driver, options, health): ...`, or start()/stop(), or
    run_until_signal() from the main thread of the daemon; serve() starts one.
    """

    def __init__(
        self,
        driver: DraDriver,
        options: Options,
        health: HealthSource | None = None,
    ) -> None:
        self.options = options
        self.dra = DRAService(driver)
        self.health = HealthService(health, options.health_interval_seconds) if health else None
        self.registration = RegistrationService(
            options.driver_name, str(options.dra_socket), supported_versions(health is not None)
        )
        self._listeners: list[_Listener] = []
        self._loop: _EventLoop | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return bool(self._listeners)

    def start(self) -> None:
        with self._lock:
            if self._listeners:
                raise ServerError("plugin server is already running")
            if self.health is not None:
                self.health.start()
            self._loop = _EventLoop()
            try:
                dra_handlers = self.dra.handlers() + (self.health.handlers() if self.health else [])
                self._listen("dra", self.options.dra_socket, dra_handlers, PREPARE_WORKERS)
                self._listen(
                    "registration",
                    self.options.registration_socket,
                    self.registration.handlers(),
                    REGISTRATION_WORKERS,
                )
            except BaseException:
                self._stop_locked(grace=0)
                raise
        log.info(
            "serving DRA at %s and registration at %s (versions %s)",
            self.options.dra_socket,
            self.options.registration_socket,
            ", ".join(self.registration.versions),
        )

    def stop(self, grace: float = 5.0) -> None:
        """Stop both servers (in-flight calls get `grace` seconds) and remove their sockets."""
        with self._lock:
            self._stop_locked(grace)

    def run_until_signal(
        self,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
        grace: float = 5.0,
        after_start: Callable[[], None] | None = None,
    ) -> signal.Signals:
        """Start, serve until one of `signals` arrives, stop cleanly; returns that signal.

        after_start runs once the sockets are served (what serving does not need waits for
        it); an exception from it stops the servers and propagates."""
        received: list[signal.Signals] = []
        done = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            received.append(signal.Signals(signum))
            done.set()

        previous = {s: signal.signal(s, on_signal) for s in signals}
        try:
            self.start()
            if after_start is not None:
                after_start()
            done.wait()
            log.info("received %s, shutting down", received[0].name)
        finally:
            self.stop(grace)
            for s, handler in previous.items():
                signal.signal(s, handler)
        return received[0]

    def __enter__(self) -> Server:
        # A server from serve() is already running; `with serve(...)` only adds the stop.
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _listen(
        self, name: str, path: Path, handlers: list[grpc.GenericRpcHandler], workers: int
    ) -> None:
        assert self._loop is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(path)
        pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"grpc-{name}")
        try:
            server = self._loop.call(_new_server(handlers, pool, path))
        except RuntimeError as exc:
            pool.shutdown(wait=False)
            raise ServerError(f"cannot listen on {name} socket {path}: {exc}") from exc
        self._listeners.append(_Listener(name, path, server, pool))

    def _stop_locked(self, grace: float) -> None:
        loop = self._loop
        if loop is None:
            return
        if self.health is not None:
            self.health.stop()
        # Registration first: the kubelet should stop using us before DRA goes away. Each
        # socket is unlinked before its server closes, so nobody new can connect meanwhile.
        for listener in reversed(self._listeners):
            listener.path.unlink(missing_ok=True)
            try:
                loop.call(listener.server.stop(grace), grace + CLOSE_TIMEOUT_S)
            except Exception:
                log.exception("stopping the %s server", listener.name)
            # Workers still busy past the grace period are left to finish on their own.
            listener.pool.shutdown(wait=False, cancel_futures=True)
        self._listeners.clear()
        loop.close()
        self._loop = None
        log.info("plugin gRPC servers stopped")


async def _new_server(
    handlers: list[grpc.GenericRpcHandler], pool: futures.ThreadPoolExecutor, path: Path
) -> grpc.aio.Server:
    """A started server on the unix socket at path; in-flight calls past stop()'s grace
    period are cancelled (their callers get CANCELLED)."""
    # Built on the loop that will run it: grpc.aio binds the running loop at construction.
    server = grpc.aio.server(pool, handlers=handlers, options=SERVER_OPTIONS)
    server.add_insecure_port(f"unix://{path}")  # RuntimeError when it cannot bind
    await server.start()
    return server


def serve(driver: DraDriver, options: Options, health: HealthSource | None = None) -> Server:
    """Serve `driver` to the kubelet: both sockets listen when this returns. Stop the returned
    Server (or leave its `with` block) to unregister and remove the sockets."""
    server = Server(driver, options, health)
    server.start()
    return server
