"""The plugin's connection to the API server: JSON in, plain dicts out, standard library only.

Why not the official client here: importing it (every configuration loader and API group) and
turning replies into its models costs the plugin more memory and start-up time than all of
its own code, while the plugin needs a few verbs on four resources and works on dicts anyway.
Credentials come from a kubeconfig (certificate, token or token file) or, in a pod, from the
service account, whose token is re-read as the kubelet rotates it. Its manners are client-go's
(api_limits): a QPS/burst limit, 429 and 5xx retried after Retry-After, idempotent requests
only retried, bounded bodies; and an idle connection is never trusted twice (see request_bytes).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urlencode, urlsplit

from flexgpu.driver.backoff import Backoff
from flexgpu.kubelet_plugin.api import api_limits as limits
from flexgpu.kubelet_plugin.api.credentials import KubeConfigError, TokenFile

JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"
SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
USER_AGENT: Final = "flexgpu-kubelet-plugin"
# The connection broke under a request: for an idempotent one, worth one more try on a new
# connection. (A refused or timed-out connection is not: the server is away, callers back off.)
_BROKEN = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    http.client.IncompleteRead,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
)
# The apiserver closes connections idle for 90 s; one idle half as long is not reused.
IDLE_REUSE_S: Final = 45.0
# What is read of an error answer to a watch (a Status object is a few hundred bytes).
ERROR_BODY_BYTES: Final = 64 * 1024


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(
        self, status: int, reason: str, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        # The server's Retry-After, for callers that wait themselves (watch loops).
        self.retry_after_s = retry_after_s


def path_of(*segments: str) -> str:
    """An API path from segments, each escaped (names may hold characters URLs reserve)."""
    return "/" + "/".join(quote(s, safe="") for s in segments)


class KubeApi:
    """Thread-safe: keeps a few idle connections and hands one to each request."""

    def __init__(
        self,
        server: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        token: Callable[[], str] | None = None,
        timeout_s: float = 30.0,
        max_idle: int = 4,
        qps: float = limits.DEFAULT_QPS,
        burst: int = limits.DEFAULT_BURST,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        url = urlsplit(server)
        if url.scheme not in ("https", "http") or not url.hostname:
            raise KubeConfigError(
                f"server {server!r}: expected https://host[:port] (or http:// for tests)"
            )
        self.server = server
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/")
        self._ssl = ssl_context or (ssl.create_default_context() if self._https else None)
        self._token = token
        self._timeout_s = timeout_s
        self._max_idle = max_idle
        self._sleep = sleep
        self.limiter = limits.RateLimiter(qps, burst, sleep=sleep)
        # Idle connections with the monotonic time each was last used.
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()
        # Requests sent, by verb: lets tests and benchmarks count API traffic.
        self.sent: dict[str, int] = {}

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_kubeconfig(cls, path: Path, **options: Any) -> KubeApi:
        import yaml  # only needed off-cluster

        from flexgpu.kubelet_plugin.api.kube_config import from_kubeconfig_doc

        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise KubeConfigError(f"kubeconfig {path}: {err}") from None
        found = from_kubeconfig_doc(doc, path.parent)
        return cls(found.server, ssl_context=found.ssl_context, token=found.token, **options)

    @classmethod
    def in_cluster(cls, sa_dir: Path = SERVICE_ACCOUNT_DIR, **options: Any) -> KubeApi:
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise KubeConfigError(
                "not in a pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are unset; "
                "pass --kubeconfig"
            )
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        context = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
        return cls(
            f"https://{host}:{port}",
            ssl_context=context,
            token=TokenFile(sa_dir / "token"),
            **options,
        )

    # -- requests --------------------------------------------------------------------------
    def get(self, path: str, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = JSON,
    ) -> dict[str, Any]:
        data = self.request_bytes(method, path, query=query, body=body, content_type=content_type)
        result: dict[str, Any] = json.loads(data) if data else {}
        return result

    def request_bytes(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = JSON,
    ) -> bytes:
        url = self._url(path, query)
        payload = None if body is None else json.dumps(body).encode()
        headers = self._headers(content_type if payload is not None else None)
        idempotent = method in limits.IDEMPOTENT
        backoff = Backoff(limits.RETRY_FIRST_S, limits.RETRY_CAP_S)
        give_up_at = time.monotonic() + limits.RETRY_BUDGET_S
        fresh = False
        for attempt in range(limits.MAX_RETRIES + 1):
            last = attempt == limits.MAX_RETRIES
            self.limiter.acquire()
            conn, reused = (self._connect(self._timeout_s), False) if fresh else self._take()
            try:
                self._count(method)
                conn.request(method, url, body=payload, headers=headers)
                response = conn.getresponse()
                data = limits.read_bounded(response)
            except _BROKEN:
                conn.close()
                # An idle connection the server closed meanwhile, or one cut mid-answer. Sent
                # again only when that cannot do anything twice, and then on a new connection:
                # another idle one may be just as stale.
                if not idempotent or last:
                    raise
                fresh = True
                if not reused:
                    self._wait(backoff.next(), give_up_at)
                continue
            except BaseException:
                conn.close()
                raise
            self._give_back(conn, response)
            if response.status < 400:
                return data
            retry_after = limits.retry_after_s(response.headers)
            error = _api_error(response.status, data, retry_after)
            if last or not limits.retriable_status(response.status, method, retry_after):
                raise error
            delay = backoff.next() if retry_after is None else retry_after
            if time.monotonic() + delay > give_up_at:
                raise error
            self._sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _wait(self, delay: float, give_up_at: float) -> None:
        if time.monotonic() + delay > give_up_at:
            raise TimeoutError(f"the API server still failed after {limits.RETRY_BUDGET_S:g} s")
        self._sleep(delay)

    def watch(self, path: str, query: Mapping[str, str], timeout_s: int = 300) -> WatchStream:
        """A watch on its own connection; iterate it for (type, object) events."""
        url = self._url(path, {**query, "watch": "1", "timeoutSeconds": str(timeout_s)})
        # The server ends the watch after timeout_s; a read that waits much longer than that
        # means the connection is dead.
        # A watch is retried by its caller's loop (with its own backoff), not here.
        self.limiter.acquire()
        conn = self._connect(timeout_s + 30.0)
        try:
            self._count("WATCH")
            conn.request("GET", url, headers=self._headers(None))
            response = conn.getresponse()
            if response.status >= 400:
                data = limits.read_bounded(response, ERROR_BODY_BYTES)
                raise _api_error(response.status, data, limits.retry_after_s(response.headers))
        except BaseException:
            conn.close()
            raise
        return WatchStream(conn, response)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    # -- plumbing --------------------------------------------------------------------------
    def _url(self, path: str, query: Mapping[str, str] | None) -> str:
        return self._prefix + path + (f"?{urlencode(dict(query))}" if query else "")

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": JSON, "User-Agent": USER_AGENT}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token()}"
        return headers

    def _count(self, verb: str) -> None:
        with self._lock:
            self.sent[verb] = self.sent.get(verb, 0) + 1

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout_s, context=self._ssl
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        """The most recently used idle connection that still looks open, else a new one."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    break
                conn, since = self._idle.pop()
            if now - since < IDLE_REUSE_S and not _closed_by_peer(conn):
                return conn, True
            conn.close()
        return self._connect(self._timeout_s), False

    def _give_back(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> None:
        if response.will_close or not response.isclosed():
            conn.close()
            return
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()


class WatchStream:
    """Events of one watch. close() from another thread ends the iteration."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self._conn = conn
        self._response = response

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        try:
            while line := self._response.readline(limits.MAX_EVENT_BYTES + 1):
                if len(line) > limits.MAX_EVENT_BYTES:
                    raise limits.ResponseTooLarge(
                        f"watch event over the client's limit of {limits.MAX_EVENT_BYTES} bytes"
                    )
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    raise ApiError(
                        int(obj.get("code", 0)),
                        str(obj.get("reason", "")),
                        str(obj.get("message", "")),
                    )
                yield str(event.get("type", "")), obj
        finally:
            self.close()

    def close(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            # Unblocks a reader waiting in another thread; close() alone would not.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """An idle connection with something to read has been closed by the server (or sent
    what nobody asked for): either way not one to send a request on."""
    sock = conn.sock
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _api_error(status: int, data: bytes, retry_after_s: float | None = None) -> ApiError:
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if isinstance(body, dict):
        reason, message = str(body.get("reason", "")), str(body.get("message", ""))
    else:
        reason = http.client.responses.get(status, "")
        message = data[:200].decode(errors="replace")
    return ApiError(status, reason, message, retry_after_s)
