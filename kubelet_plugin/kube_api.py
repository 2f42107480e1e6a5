"""The plugin's connection to the API server: JSON in, plain dicts out, standard library only.

Why not the official client here: importing it (every configuration loader and API group) and
turning replies into its models costs the plugin more memory and start-up time than all of
its own code, while the plugin needs a few verbs on four resources and works on dicts anyway.
Credentials come from a kubeconfig (certificate, token or token file) or, in a pod, from the
service account, whose token is re-read as the kubelet rotates it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urlencode, urlsplit

JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"
SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Bound service-account tokens are refreshed by the kubelet well before they expire.
TOKEN_REREAD_S: Final = 60.0
USER_AGENT: Final = "flexgpu-kubelet-plugin"
_RETRY_ON_REUSED = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class KubeConfigError(ValueError):
    """Credentials cannot be built from the kubeconfig or the pod's service account."""


def path_of(*segments: str) -> str:
    """An API path from segments, each escaped (names may hold characters URLs reserve)."""
    return "/" + "/".join(quote(s, safe="") for s in segments)


class TokenFile:
    """A bearer token read from a file, re-read periodically so rotation is followed."""

    def __init__(self, path: Path, reread_s: float = TOKEN_REREAD_S) -> None:
        self._path = path
        self._reread_s = reread_s
        self._token = ""
        self._read_at = -reread_s
        self._lock = threading.Lock()

    def __call__(self) -> str:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= self._reread_s:
                self._token = self._path.read_text().strip()
                self._read_at = now
            return self._token


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
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        # Requests sent, by verb: lets tests and benchmarks count API traffic.
        self.sent: dict[str, int] = {}

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeApi:
        import yaml  # only needed off-cluster

        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise KubeConfigError(f"kubeconfig {path}: {err}") from None
        return _from_kubeconfig_doc(doc, path.parent)

    @classmethod
    def in_cluster(cls, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeApi:
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
        return cls(f"https://{host}:{port}", ssl_context=context, token=TokenFile(sa_dir / "token"))

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
        for attempt in range(2):
            conn, reused = self._take()
            try:
                self._count(method)
                conn.request(method, url, body=payload, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except _RETRY_ON_REUSED:
                conn.close()
                # A kept-alive connection the server had already closed: try once on a fresh one.
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            self._give_back(conn, response)
            if response.status >= 400:
                raise _api_error(response.status, data)
            return data
        raise AssertionError("unreachable")  # pragma: no cover

    def watch(self, path: str, query: Mapping[str, str], timeout_s: int = 300) -> WatchStream:
        """A watch on its own connection; iterate it for (type, object) events."""
        url = self._url(path, {**query, "watch": "1", "timeoutSeconds": str(timeout_s)})
        # The server ends the watch after timeout_s; a read that waits much longer than that
        # means the connection is dead.
        conn = self._connect(timeout_s + 30.0)
        try:
            self._count("WATCH")
            conn.request("GET", url, headers=self._headers(None))
            response = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        if response.status >= 400:
            data = response.read()
            conn.close()
            raise _api_error(response.status, data)
        return WatchStream(conn, response)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
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
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(self._timeout_s), False

    def _give_back(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> None:
        if response.will_close:
            conn.close()
            return
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()


class WatchStream:
    """Events of one watch. close() from another thread ends the iteration."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self._conn = conn
        self._response = response

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        try:
            while line := self._response.readline():
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


def _api_error(status: int, data: bytes) -> ApiError:
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")))
    return ApiError(
        status, http.client.responses.get(status, ""), data[:200].decode(errors="replace")
    )


def _named(doc: Mapping[str, Any], kind: str, name: str) -> dict[str, Any]:
    for entry in doc.get(kind) or []:
        if entry.get("name") == name:
            return dict(entry.get(kind[:-1]) or {})
    raise KubeConfigError(f"kubeconfig: {kind[:-1]} {name!r} is not defined under {kind}")


def _from_kubeconfig_doc(doc: Mapping[str, Any], base: Path) -> KubeApi:
    context_name = doc.get("current-context")
    if not context_name:
        raise KubeConfigError("kubeconfig: current-context is not set")
    context = _named(doc, "contexts", str(context_name))
    cluster = _named(doc, "clusters", str(context.get("cluster", "")))
    user = _named(doc, "users", str(context.get("user", ""))) if context.get("user") else {}
    for unsupported in ("exec", "auth-provider", "username", "password"):
        if unsupported in user:
            raise KubeConfigError(
                f"kubeconfig user {context.get('user')!r}: {unsupported!r} is not supported; "
                "allowed: token, tokenFile, client-certificate(-data) with client-key(-data)"
            )
    if "tls-server-name" in cluster or "proxy-url" in cluster:
        raise KubeConfigError(
            f"kubeconfig cluster {context.get('cluster')!r}: tls-server-name and proxy-url are "
            "not supported; allowed: server, certificate-authority(-data), "
            "insecure-skip-tls-verify"
        )
    server = str(cluster.get("server", ""))
    context_ssl = None
    if server.startswith("https"):
        context_ssl = _tls(cluster, user, base)
    token: Callable[[], str] | None = None
    if user.get("token"):
        value = str(user["token"])
        token = lambda: value  # noqa: E731
    elif user.get("tokenFile"):
        token = TokenFile(_resolve(base, str(user["tokenFile"])))
    return KubeApi(server, ssl_context=context_ssl, token=token)


def _resolve(base: Path, name: str) -> Path:
    path = Path(name)
    return path if path.is_absolute() else base / path


def _tls(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path) -> ssl.SSLContext:
    import base64

    if cluster.get("insecure-skip-tls-verify"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif cluster.get("certificate-authority-data"):
        pem = base64.b64decode(str(cluster["certificate-authority-data"])).decode()
        context = ssl.create_default_context(cadata=pem)
    elif cluster.get("certificate-authority"):
        ca = _resolve(base, str(cluster["certificate-authority"]))
        context = ssl.create_default_context(cafile=str(ca))
    else:
        context = ssl.create_default_context()
    cert, key = user.get("client-certificate-data"), user.get("client-key-data")
    if cert and key:
        # The ssl module loads certificates only from files: write them privately, then drop.
        with tempfile.TemporaryDirectory(prefix="flexgpu-tls-") as tmp:
            cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            for path, data in ((cert_path, cert), (key_path, key)):
                path.write_bytes(base64.b64decode(str(data)))
                path.chmod(0o600)
            context.load_cert_chain(str(cert_path), str(key_path))
    elif user.get("client-certificate") and user.get("client-key"):
        context.load_cert_chain(
            str(_resolve(base, str(user["client-certificate"]))),
            str(_resolve(base, str(user["client-key"]))),
        )
    return context
