"""The plugin's /livez and /readyz: 200 while the verdict is None, 503 with the reason
otherwise (a check that raises is a failed probe, never a dead endpoint), 404 elsewhere."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from flexgpu.kubelet_plugin.observe.health_endpoint import HealthEndpoint

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


def test_plugin_readiness_waits_for_prepares_and_a_published_slice() -> None:
    """/readyz of the plugin: not before the gate serves prepares, then not before the slice
    publisher's first pass went through (saying why it failed), then ready."""
    from flexgpu.kubelet_plugin.claims.startup_gate import StartupGate
    from flexgpu.kubelet_plugin.main import NodeReadiness

    class Publisher:
        published = False
        last_error: str | None = "the API server is unreachable"

    gate = StartupGate()
    readiness = NodeReadiness(gate)
    assert readiness() == "starting: prepares are not served yet"

    class Health:
        pass

    gate.open(Health())  # type: ignore[arg-type]
    assert readiness() == "ResourceSlices not published yet"
    publisher = Publisher()
    readiness.publisher = publisher  # type: ignore[assignment]
    assert readiness() == "ResourceSlices not published yet: the API server is unreachable"
    publisher.published, publisher.last_error = True, None
    assert readiness() is None


def test_the_charts_health_port_setting_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEXGPU_HEALTH_PORT as the chart sets it (a string) configures the port; a bad one is
    refused naming the setting and what is allowed."""
    from flexgpu.kubelet_plugin.config import ConfigError
    from flexgpu.kubelet_plugin.config_flags import load_config

    monkeypatch.setenv("FLEXGPU_NODE_NAME", "node-a")
    monkeypatch.setenv("FLEXGPU_HEALTH_PORT", "8083")
    assert load_config([]).health_port == 8083
    monkeypatch.setenv("FLEXGPU_HEALTH_PORT", "http")
    with pytest.raises(ConfigError, match=r"health_port .*'http' is not a port number; allowed: 0"):
        load_config([])
    monkeypatch.setenv("FLEXGPU_HEALTH_PORT", "70000")
    with pytest.raises(ConfigError, match="health_port"):
        load_config([])
