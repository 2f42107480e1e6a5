"""bench/pod_phases.py reads a pod's start phases from containerd's CRI log lines (logrus
text, as the real node writes them) and groups traced program runs by what they are."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.exec_trace import Run
from bench.pod_phases import PodTimes, phase_medians, program_times, read_containerd_log

SANDBOX = "a" * 64
CONTAINER = "b" * 64
OTHER_SANDBOX = "c" * 64
META = r"&PodSandboxMetadata{Name:fg-s0,Uid:1234,Namespace:podstart,Attempt:0,}"
LOG = [
    f'time="2026-12-02T10:00:01.000000000Z" level=info msg="RunPodsandbox for {META}"',
    'time="2026-12-02T10:00:01.100000000Z" level=info msg="unrelated line"',
    f'time="2026-12-02T10:00:01.250000000Z" level=info msg="RunPodSandbox for {META} '
    f'returns sandbox id \\"{SANDBOX}\\""',
    f'time="2026-12-02T10:00:01.300000000Z" level=info msg="CreateContainer within sandbox '
    f'\\"{SANDBOX}\\" for container &ContainerMetadata{{Name:main,Attempt:0,}}"',
    f'time="2026-12-02T10:00:01.350000000Z" level=info msg="CreateContainer within sandbox '
    f'\\"{SANDBOX}\\" for &ContainerMetadata{{Name:main,Attempt:0,}} returns container id '
    f'\\"{CONTAINER}\\""',
    f'time="2026-12-02T10:00:01.360000000Z" level=info msg="StartContainer for \\"{CONTAINER}\\""',
    f'time="2026-12-02T10:00:01.560000000Z" level=info msg="StartContainer for '
    f'\\"{CONTAINER}\\" returns successfully"',
    # Another pod's lines are not this pod's.
    'time="2026-12-02T10:00:02.000000000Z" level=info msg="RunPodSandbox for '
    "&PodSandboxMetadata{Name:other,Uid:9,Namespace:podstart,Attempt:0,} returns sandbox id "
    f'\\"{OTHER_SANDBOX}\\""',
]
T0 = 1796205601.0  # 2026-12-02T10:00:01Z


def test_the_cri_calls_of_a_pod_give_its_phases(tmp_path: Path) -> None:
    log = tmp_path / "containerd.log"
    log.write_text("\n".join(LOG) + "\n")
    times = PodTimes(created=T0 - 0.5, bound=T0 - 0.3, running=T0 + 0.76)
    containers = read_containerd_log(log, {"fg-s0": times})
    assert containers == {CONTAINER: "fg-s0"}
    phases = times.phases()
    expected = {
        "bind": 0.2,
        "kubelet + prepare": 0.3,
        "sandbox": 0.25,
        "container config": 0.05,
        "create": 0.05,
        "start": 0.21,
        "seen running": 0.2,
    }
    assert phases == pytest.approx(expected, abs=1e-5)


def test_a_phase_not_seen_is_left_out_of_the_medians() -> None:
    seen = PodTimes(created=0.0, bound=1.0)
    medians = phase_medians([seen, PodTimes(created=0.0, bound=3.0)])
    assert medians["bind s"] == 1.0
    assert math.isnan(medians["sandbox s"])


def test_runs_are_grouped_by_what_they_are() -> None:
    def run(*argv: str, ms: float, pid: int = 1, ancestors: tuple[int, ...] = ()) -> Run:
        return Run(pid, argv, 0, int(ms * 1e6), ancestors)

    runs = [
        run("runc", "--root", "/r", "create", "--bundle", "/b", CONTAINER, ms=80, pid=5),
        run("runc", "--root", "/r", "create", "--bundle", "/b", SANDBOX, ms=50, pid=4),
        run("runc", "--root", "/r", "start", CONTAINER, ms=10, pid=6),
        run("runc", "init", ms=70, pid=3, ancestors=(5,)),
        run("nvidia-cdi-hook", "update-ldcache", "--folder", "/x", ms=30, pid=7, ancestors=(3, 5)),
        run(
            "flexgpu-cdi-hooks",
            '["create-symlinks"]',
            '["update-ldcache"]',
            ms=40,
            ancestors=(3, 5),
        ),
        run("/sbin/ldconfig", "-r", "/", ms=5, pid=9, ancestors=(8, 7, 3, 5)),
        # Another node's container (its runc is not this node's pods'): not counted.
        run("nvidia-cdi-hook", "update-ldcache", ms=99, pid=20, ancestors=(19,)),
        run("/sbin/ldconfig", ms=99, pid=21, ancestors=(20, 19)),
    ]
    grouped = program_times(runs, {CONTAINER: "fg-s0"}).seconds
    assert grouped == {
        "runc create": [0.08],  # the sandbox's is not a container's start
        "runc start": [0.01],
        "hook update-ldcache": [0.03],
        "hook flexgpu-cdi-hooks (2 hooks)": [0.04],
        "ldconfig (in update-ldcache)": [0.005],
    }
