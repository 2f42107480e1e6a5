"""Lifecycle of the plugin's two gRPC servers on unix sockets.

The DRA server (DRAPlugin v1/v1beta1 and, with a HealthSource, DRAResourceHealth v1/v1alpha1)
listens on the DRA socket; the registration server listens in the kubelet's plugin registry
directory, where its appearance is what makes the kubelet call us. DRA starts first so it is
ready when the kubelet follows the registration; on stop, registration goes first.

We use grpc's thread-pool server, not grpc.aio: prepare, the checkpoint, file locks and NVML are
all blocking calls, and the load is a handful of calls per pod, so worker threads are simpler
than an event loop that would hand every call to an executor anyway.
"""

from __future__ import annotations

import logging
import signal
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

import grpc

from kubelet_plugin.claims import ClaimPreparer
from kubelet_plugin.config import PluginConfig
from kubelet_plugin.dra_service import DRAService
from kubelet_plugin.health import HealthSource
from kubelet_plugin.health_service import HealthService
from kubelet_plugin.registration import RegistrationService, supported_versions

log = logging.getLogger(__name__)

# Each open health stream holds a worker for its lifetime; the rest serve prepare/unprepare.
DRA_WORKERS = 8
REGISTRATION_WORKERS = 2


class ServerError(RuntimeError):
    """A gRPC server could not be started."""


@dataclass
class _Listener:
    name: str
    path: Path
    server: grpc.Server
    pool: futures.ThreadPoolExecutor


class PluginServer:
    """Serves registration and DRA for one plugin process.

    Usage: `with PluginServer(config, preparer, health): ...`, or start()/stop(), or
    run_until_signal() from the main thread of the daemon.
    """

    def __init__(
        self,
        config: PluginConfig,
        preparer: ClaimPreparer,
        health: HealthSource | None = None,
    ) -> None:
        self.config = config
        self.dra = DRAService(preparer)
        self.health = HealthService(health, config.health_interval_seconds) if health else None
        self.registration = RegistrationService(
            config.driver_name, str(config.dra_socket), supported_versions(health is not None)
        )
        self._listeners: list[_Listener] = []
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
            try:
                dra_handlers = self.dra.handlers() + (self.health.handlers() if self.health else [])
                self._listen("dra", self.config.dra_socket, dra_handlers, DRA_WORKERS)
                self._listen(
                    "registration",
                    self.config.registration_socket,
                    self.registration.handlers(),
                    REGISTRATION_WORKERS,
                )
            except BaseException:
                self._stop_locked(grace=0)
                raise
        log.info(
            "serving DRA at %s and registration at %s (versions %s)",
            self.config.dra_socket,
            self.config.registration_socket,
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

    def __enter__(self) -> PluginServer:
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
        self,
        name: str,
        path: Path,
        handlers: list[grpc.GenericRpcHandler],
        workers: int,
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_socket(path)
        pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"grpc-{name}")
        server = grpc.server(pool, handlers=handlers)
        listener = _Listener(name, path, server, pool)
        self._listeners.append(listener)
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as exc:
            raise ServerError(f"cannot listen on {name} socket {path}: {exc}") from exc
        server.start()

    def _stop_locked(self, grace: float) -> None:
        if not self._listeners:
            return
        if self.health is not None:
            self.health.stop()
        # Registration first: the kubelet should stop using us before DRA goes away.
        for listener in reversed(self._listeners):
            listener.server.stop(grace).wait(grace + 1)
            # Workers still busy past the grace period are left to finish on their own.
            listener.pool.shutdown(wait=False, cancel_futures=True)
            # gRPC unlinks its unix socket on shutdown; this covers a listener that did not.
            listener.path.unlink(missing_ok=True)
        self._listeners.clear()
        log.info("plugin gRPC servers stopped")


def remove_stale_socket(path: Path) -> None:
    """Remove what a previous instance left at path; refuse to delete a directory."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise ServerError(f"socket path {path} is a directory")
    log.info("removing stale socket %s", path)
    path.unlink()
