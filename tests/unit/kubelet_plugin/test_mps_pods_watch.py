"""The MPS daemon pods' crash watch runs on driver.loop.Loop: it checks every interval, keeps
checking after a failed round (the API server away), and close() leaves no thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.agents.mps_pods import MpsDaemonPods
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi


@contextlib.contextmanager
def _no_lock(index: int) -> Iterator[None]:
    yield


def test_watch_survives_a_failed_round_and_close_ends_it(tmp_path: Path) -> None:
    backend = SimulatedBackend.from_topology("l4-2-pcie", "n", state_path=tmp_path / "s.json")
    pods = MpsDaemonPods(
        FakeKubeApi(),  # type: ignore[arg-type]
        backend,
        node_name="n",
        namespace="flexgpu",
        image="img",
        mps_root=tmp_path / "mps",
        driver_root=tmp_path,
    )
    rounds: list[str] = []
    third = threading.Event()

    def restart_ended(
        in_use: Callable[[], set[int]],
        locked: Callable[[int], contextlib.AbstractContextManager[None]],
    ) -> list[int]:
        rounds.append(threading.current_thread().name)
        if len(rounds) == 1:
            raise ConnectionError("API server away")
        if len(rounds) == 3:
            third.set()
        return []

    pods.restart_ended = restart_ended  # type: ignore[method-assign]
    pods.watch(lambda: {0}, _no_lock, interval_s=0.02)
    assert third.wait(10), f"the watch stopped after {len(rounds)} round(s)"
    assert set(rounds) == {"mps-daemon-watch"}
    pods.close()
    assert not any(t.name == "mps-daemon-watch" and t.is_alive() for t in threading.enumerate())
