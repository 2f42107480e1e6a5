"""The plugin's API client against a local HTTP server: JSON both ways, the server's error
as ApiError, kept-alive connections, watch streams, and credentials from a kubeconfig."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from flexgpu.kubelet_plugin.api.credentials import KubeConfigError, TokenFile
from flexgpu.kubelet_plugin.api.kube_api import ApiError, KubeApi, path_of


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[dict[str, Any]]] = []
    peers: ClassVar[set[int]] = set()

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        Handler.peers.add(self.client_address[1])
        Handler.seen.append(
            {
                "method": self.command,
                "path": self.path,
                "auth": self.headers.get("Authorization"),
                "type": self.headers.get("Content-Type"),
                "body": json.loads(body) if body else None,
            }
        )
        return body

    def do_GET(self) -> None:
        self._record()
        if self.path.startswith("/api/v1/nodes?") and "watch=1" in self.path:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in (
                {"type": "ADDED", "object": {"metadata": {"name": "n", "resourceVersion": "5"}}},
                {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "old"}},
            ):
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/api/v1/nodes/n":
            self._reply(200, {"metadata": {"name": "n"}})
        else:
            self._reply(404, {"kind": "Status", "reason": "NotFound", "message": "no such thing"})

    def do_PATCH(self) -> None:
        body = self._record()
        self._reply(200, json.loads(body))


@pytest.fixture
def server() -> Iterator[str]:
    Handler.seen, Handler.peers = [], set()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_json_requests_reuse_one_connection_and_send_the_token(server: str) -> None:
    api = KubeApi(server, token=lambda: "secret")
    assert api.get("/api/v1/nodes/n") == {"metadata": {"name": "n"}}
    patched = api.request(
        "PATCH", "/api/v1/nodes/n", body={"a": 1}, content_type="application/merge-patch+json"
    )
    assert patched == {"a": 1}
    assert [(s["method"], s["auth"], s["type"]) for s in Handler.seen] == [
        ("GET", "Bearer secret", None),
        ("PATCH", "Bearer secret", "application/merge-patch+json"),
    ]
    assert len(Handler.peers) == 1  # kept alive
    assert api.sent == {"GET": 1, "PATCH": 1}
    api.close()


def test_server_errors_become_api_errors_with_status_and_message(server: str) -> None:
    with pytest.raises(ApiError) as err:
        KubeApi(server).get("/apis/x/v1/things/y")
    assert (err.value.status, err.value.reason, err.value.message) == (
        404,
        "NotFound",
        "no such thing",
    )


def test_watch_yields_events_and_raises_the_error_event(server: str) -> None:
    stream = KubeApi(server).watch("/api/v1/nodes", {"resourceVersion": "4"}, timeout_s=5)
    events = []
    with pytest.raises(ApiError) as err:
        for kind, obj in stream:
            events.append((kind, obj["metadata"]["name"]))
    assert events == [("ADDED", "n")]
    assert err.value.status == 410
    assert "watch=1" in Handler.seen[0]["path"] and "resourceVersion=4" in Handler.seen[0]["path"]


def test_names_are_escaped_in_paths() -> None:
    assert path_of("api", "v1", "namespaces", "a b", "x/y") == "/api/v1/namespaces/a%20b/x%2Fy"


def kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any]) -> Path:
    doc = {
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def test_kubeconfig_token_file_is_relative_to_the_kubeconfig(server: str, tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    api = KubeApi.from_kubeconfig(kubeconfig(tmp_path, {"tokenFile": "tok"}, {"server": server}))
    api.get("/api/v1/nodes/n")
    assert Handler.seen[-1]["auth"] == "Bearer from-file"


def test_kubeconfig_refusals_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="'exec' is not supported; allowed: token"):
        KubeApi.from_kubeconfig(
            kubeconfig(tmp_path, {"exec": {"command": "x"}}, {"server": "https://h"})
        )
    with pytest.raises(KubeConfigError, match="server 'h:6443': expected https://host"):
        KubeApi.from_kubeconfig(kubeconfig(tmp_path, {}, {"server": "h:6443"}))
    (tmp_path / "empty").write_text("{}")
    with pytest.raises(KubeConfigError, match="current-context is not set"):
        KubeApi.from_kubeconfig(tmp_path / "empty")


def test_in_cluster_needs_the_service_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        KubeApi.in_cluster()


def test_token_file_is_reread_after_its_interval(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("one")
    token = TokenFile(path, reread_s=0.0)
    assert token() == "one"
    path.write_text("two")  # the kubelet rotated it
    assert token() == "two"
    cached = TokenFile(path, reread_s=3600)
    assert cached() == "two"
    path.write_text("three")
    assert cached() == "two"
