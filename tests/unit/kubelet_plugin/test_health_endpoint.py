"""The plugin's /livez and /readyz: 200 while the verdict is None, 503 with the reason
otherwise (a check that raises is a failed probe, never a dead endpoint), 404 elsewhere."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from flexgpu.kubelet_plugin.health_endpoint import HealthEndpoint

state: dict[str, str | None] = {}


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode().strip()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode().strip()


def _ready() -> str | None:
    if state.get("raise"):
        raise RuntimeError("publisher gone")
    return state.get("ready")


@pytest.fixture
def endpoint() -> Iterator[HealthEndpoint]:
    state.clear()
    served = HealthEndpoint(0, alive=lambda: state.get("alive"), ready=_ready, address="127.0.0.1")
    yield served
    served.stop()


def test_answers_follow_the_verdicts(endpoint: HealthEndpoint) -> None:
    assert _get(endpoint.port, "/livez") == (200, "ok")
    assert _get(endpoint.port, "/readyz") == (200, "ok")
    state["ready"] = "no ResourceSlice published yet"
    assert _get(endpoint.port, "/readyz") == (503, "no ResourceSlice published yet")
    assert _get(endpoint.port, "/livez") == (200, "ok")
    state["alive"] = "plugin not answering: no reply within 5 s"
    assert _get(endpoint.port, "/livez") == (503, "plugin not answering: no reply within 5 s")


def test_a_check_that_raises_is_a_failed_probe(endpoint: HealthEndpoint) -> None:
    state["raise"] = "yes"
    assert _get(endpoint.port, "/readyz") == (503, "RuntimeError: publisher gone")
    state.clear()
    assert _get(endpoint.port, "/readyz") == (200, "ok")


def test_other_paths_are_not_found(endpoint: HealthEndpoint) -> None:
    status, text = _get(endpoint.port, "/metrics")
    assert status == 404 and "/livez" in text
