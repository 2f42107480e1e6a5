"""The API client's manners against a local server that misbehaves as proxies and loaded
apiservers do: watches ended at once or cut mid-chunk, 429 and 503 with Retry-After,
kept-alive connections closed under a request, oversized bodies. Each test states the bound
it holds the client to."""

from __future__ import annotations

import http.client
import itertools
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from flexgpu.kubelet_plugin.api import api_limits
from flexgpu.kubelet_plugin.api.api_limits import RateLimiter, ResponseTooLarge
from flexgpu.kubelet_plugin.api.kube_api import ApiError, KubeApi
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects

PODS = "/api/v1/namespaces/flexgpu/pods"


@dataclass
class Behaviour:
    """What the server does; tests change it while it runs."""

    watch: str = "end"  # "end": ends each watch at once; "cut": cuts it mid-chunk
    status: int = 200  # answer to every non-watch request
    retry_after: str | None = None
    errors_left: int = 1_000_000  # how many answers get `status` before 200s
    body_bytes: int = 0  # pad list answers to this size
    chunked: bool = False
    # Connections (numbered as accepted) whose next request is read and then dropped
    # without an answer. Numbers, not client ports: a new connection may reuse a port.
    drop_conns: set[int] = field(default_factory=set)
    accepted: int = 0
    # Requests wait here until as many have arrived as it has parties (overlapping calls).
    hold: threading.Barrier | None = None
    # Close each connection right after answering (an idle timeout, without saying so).
    close_after_answer: bool = False
    requests: list[tuple[float, str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    behaviour: Behaviour

    def log_message(self, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        b: Behaviour = self.server.behaviour  # type: ignore[attr-defined]
        with b.lock:
            b.accepted += 1
            self.conn_no = b.accepted

    def _note(self) -> Behaviour:
        b = self.server.behaviour  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        with b.lock:
            b.requests.append((time.monotonic(), self.command, self.path, self.conn_no))
        return b  # type: ignore[no-any-return]

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        b: Behaviour = self.server.behaviour  # type: ignore[attr-defined]
        if b.chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        if b.close_after_answer:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _answer(self) -> None:
        b = self._note()
        if b.hold is not None:
            b.hold.wait(10)
        if self.conn_no in b.drop_conns:
            # Read, then closed without an answer: what a kept-alive connection the server
            # timed out looks like when the request crosses the close.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if "watch=1" in self.path:
            self._watch(b)
            return
        with b.lock:
            failing = b.status != 200 and b.errors_left > 0
            b.errors_left -= failing
        if failing:
            headers = {"Retry-After": b.retry_after} if b.retry_after is not None else {}
            status = {"kind": "Status", "reason": "TooManyRequests", "message": "slow down"}
            self._send(b.status, json.dumps(status).encode(), headers)
            return
        listed: dict[str, Any] = {"metadata": {"resourceVersion": "10"}, "items": []}
        if b.body_bytes:
            listed["pad"] = "x" * b.body_bytes
        self._send(200, json.dumps(listed).encode())

    def _watch(self, b: Behaviour) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if b.watch == "cut":
            self.wfile.write(b"100\r\n" + b'{"type":"ADDED","obj')  # 256 announced, 20 sent
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(b"0\r\n\r\n")  # a clean end at once

    do_GET = _answer
    do_POST = _answer


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour()


@pytest.fixture
def server(behaviour: Behaviour) -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.behaviour = behaviour  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _requests_for(seconds: float, copy: WatchedObjects, behaviour: Behaviour) -> int:
    copy.start()
    try:
        time.sleep(seconds)
        with behaviour.lock:
            return len(behaviour.requests)
    finally:
        copy.stop()


@pytest.mark.parametrize("how", ["end", "cut"])
def test_watches_that_end_at_once_are_reopened_with_growing_delays(
    server: str, behaviour: Behaviour, how: str
) -> None:
    """Each watch ended cleanly at once, or cut mid-chunk: in 4 s the client sends at most
    5 requests (1 LIST, then WATCHes after 0.4-0.8, 0.8-1.6, 1.6-3.2 s...), where reopening
    at once made over a thousand in 2 s."""
    behaviour.watch = how
    copy = WatchedObjects(KubeApi(server), PODS, name="pods")
    sent = _requests_for(4.0, copy, behaviour)
    assert copy.synced
    assert 2 <= sent <= 5, behaviour.requests
    methods = [path.split("?")[1] for _, _, path, _ in behaviour.requests]
    assert "watch=1" not in methods[0] and "resourceVersion=0" in methods[0]  # the first LIST
    assert all("watch=1" in m for m in methods[1:])  # no relist after a clean end or a cut


@pytest.mark.parametrize("status", [429, 503])
def test_a_throttling_server_sees_requests_no_faster_than_its_retry_after(
    server: str, behaviour: Behaviour, status: int
) -> None:
    """Every answer is 429 or 503 with Retry-After: 1: in 4 s at most 5 requests arrive
    (one a second, as asked, plus the first)."""
    behaviour.status, behaviour.retry_after = status, "1"
    copy = WatchedObjects(KubeApi(server), PODS, name="pods")
    sent = _requests_for(4.0, copy, behaviour)
    assert not copy.synced
    assert 2 <= sent <= 5, behaviour.requests
    times = [t for t, *_ in behaviour.requests]
    assert all(b - a >= 0.95 for a, b in itertools.pairwise(times)), times


def test_429_is_retried_after_retry_after_for_any_verb(server: str, behaviour: Behaviour) -> None:
    behaviour.status, behaviour.retry_after, behaviour.errors_left = 429, "2", 2
    waits: list[float] = []
    api = KubeApi(server, sleep=waits.append)
    assert api.request("POST", PODS, body={"metadata": {"name": "p"}})["items"] == []
    assert waits == [2.0, 2.0]
    assert [m for _, m, _, _ in behaviour.requests] == ["POST"] * 3


def test_503_is_retried_for_a_get_but_never_for_a_post(server: str, behaviour: Behaviour) -> None:
    behaviour.status, behaviour.retry_after, behaviour.errors_left = 503, "1", 1
    waits: list[float] = []
    api = KubeApi(server, sleep=waits.append)
    assert api.get(PODS)["items"] == []
    assert waits == [1.0]
    behaviour.errors_left = 1
    with pytest.raises(ApiError) as err:
        api.request("POST", PODS, body={"metadata": {"name": "p"}})
    assert err.value.status == 503 and err.value.retry_after_s == 1.0
    assert [m for _, m, _, _ in behaviour.requests] == ["GET", "GET", "POST"]


def test_a_server_that_never_stops_throttling_gets_a_bounded_number_of_tries(
    server: str, behaviour: Behaviour
) -> None:
    behaviour.status, behaviour.retry_after = 429, "0"
    api = KubeApi(server, sleep=lambda s: None)
    with pytest.raises(ApiError) as err:
        api.get(PODS)
    assert err.value.status == 429
    assert len(behaviour.requests) == api_limits.MAX_RETRIES + 1


def _pool_two_connections(api: KubeApi, behaviour: Behaviour) -> set[int]:
    """Two requests at once leave two kept-alive connections in the client's pool; returns
    their numbers."""
    results: list[Any] = []

    def call() -> None:
        results.append(api.get(PODS))

    behaviour.hold = threading.Barrier(2)  # each answered once both have arrived
    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    behaviour.hold = None
    conns = {conn for *_, conn in behaviour.requests}
    assert len(results) == 2 and len(conns) == 2, conns
    return conns


def test_two_stale_pooled_connections_do_not_fail_a_get(server: str, behaviour: Behaviour) -> None:
    """Both pooled connections are closed by the server as the next request crosses the
    close: the GET is sent again on a new connection, not on the other stale one."""
    api = KubeApi(server)
    stale = _pool_two_connections(api, behaviour)
    behaviour.drop_conns = set(stale)
    before = len(behaviour.requests)
    assert api.get(PODS)["items"] == []
    tried = [conn for *_, conn in behaviour.requests[before:]]
    assert len(tried) == 2, tried
    assert tried[0] in stale and tried[1] not in stale  # one stale try, then a new one


def test_a_post_on_a_connection_closed_under_it_is_not_sent_twice(
    server: str, behaviour: Behaviour
) -> None:
    api = KubeApi(server)
    behaviour.drop_conns = _pool_two_connections(api, behaviour)
    before = len(behaviour.requests)
    with pytest.raises(http.client.RemoteDisconnected):
        api.request("POST", PODS, body={"metadata": {"name": "p"}})
    assert len(behaviour.requests) - before == 1  # it may have been done: not again


def test_an_idle_connection_the_server_closed_is_not_used(
    server: str, behaviour: Behaviour
) -> None:
    """A pooled connection the server has closed while idle (its FIN already arrived) is
    dropped before use, so even a POST goes out on a new connection and succeeds."""
    api = KubeApi(server)
    # Left on: turned off right after the answer, the server thread could read it off before
    # closing (seen under load); the POST's own connection closing after it changes nothing.
    behaviour.close_after_answer = True
    api.get(PODS)
    assert len(api._idle) == 1  # kept: the answer did not say it would close
    # Wait (bounded) until the server's FIN has reached the pooled socket: readable at EOF.
    ((conn, _),) = api._idle
    assert conn.sock is not None
    ready, _, _ = select.select([conn.sock], [], [], 10.0)
    assert ready, "the server's close never arrived"
    assert api.request("POST", PODS, body={"metadata": {"name": "p"}})["items"] == []
    # One try, on a second connection: none on the closed one.
    assert [conn for *_, conn in behaviour.requests] == [1, 2]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_refused(
    server: str, behaviour: Behaviour, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_limits, "MAX_BODY_BYTES", 10_000)
    behaviour.body_bytes, behaviour.chunked = 20_000, chunked
    with pytest.raises(ResponseTooLarge, match="limit of 10000 bytes"):
        KubeApi(server).get(PODS)


def test_rate_limiter_allows_the_burst_then_the_rate() -> None:
    now = [0.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)

    limiter = RateLimiter(qps=2.0, burst=3, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        limiter.acquire()
    # Three at once; the 4th and 5th reserve the next half-second slots.
    assert waits == pytest.approx([0.5, 1.0])
    now[0] = 10.0  # a long quiet spell refills the bucket to the burst, no more
    waits.clear()
    for _ in range(4):
        limiter.acquire()
    assert waits == pytest.approx([0.5])


def test_the_client_sends_no_faster_than_its_qps(server: str, behaviour: Behaviour) -> None:
    api = KubeApi(server, qps=20.0, burst=2)
    started = time.monotonic()
    for _ in range(12):
        api.get(PODS)
    # 2 at once, then 10 more at 20/s: at least 0.5 s.
    assert time.monotonic() - started >= 0.45


@pytest.mark.parametrize(
    ("qps", "burst", "problem"),
    [(0.0, 1, "qps 0.0: allowed: a number greater than 0"), (1.0, 0, "burst 0")],
)
def test_bad_limits_are_refused_by_name(qps: float, burst: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        RateLimiter(qps, burst)
