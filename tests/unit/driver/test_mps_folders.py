"""An MPS daemon's folders are emptied without following what a client planted there, and a
daemon is found by its process: only the control program with the folder in its
environment counts, not another program with the same environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexgpu.driver.mps_folders import (
    CONTROL_PROGRAM,
    control_daemon_running,
    control_pipe_problem,
    reset_folder,
)
from tests.conftest import wait_for


def test_a_folder_replaced_by_a_symlink_becomes_a_folder_again(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("host file")
    folder = tmp_path / "gpu" / "pipe"
    folder.parent.mkdir()
    folder.symlink_to(victim)
    reset_folder(folder, 0o755)
    assert folder.is_dir() and not folder.is_symlink()
    assert (victim / "keep").read_text() == "host file"
    assert list(folder.iterdir()) == []


def test_emptying_is_idempotent_and_keeps_the_folder_itself(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    folder.mkdir(mode=0o700)
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "f").write_text("x")
    inode = folder.stat().st_ino
    reset_folder(folder, 0o1777)
    reset_folder(folder, 0o1777)  # as after a kill half-way
    assert folder.stat().st_ino == inode  # a client's bind mount still shows this folder
    assert list(folder.iterdir()) == []
    assert folder.stat().st_mode & 0o7777 == 0o1777


def test_links_only_keeps_a_running_clients_files(tmp_path: Path) -> None:
    """Before a daemon starts again, clients of the one that ended may still run: their
    /dev/shm files stay, the links go, wherever they are."""
    victim = tmp_path / "victim"
    victim.mkdir()
    shm = tmp_path / "shm"
    (shm / "torch").mkdir(parents=True)
    (shm / "torch" / "tensor").write_text("data")
    (shm / "link").symlink_to(victim)
    (shm / "torch" / "deep").symlink_to(victim)
    reset_folder(shm, 0o1777, links_only=True)
    assert (shm / "torch" / "tensor").read_text() == "data"
    assert not (shm / "link").is_symlink() and not (shm / "torch" / "deep").is_symlink()
    assert victim.is_dir()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def _start(tmp_path: Path, name: str, pipe: Path, started: list[subprocess.Popen[bytes]]) -> None:
    program = tmp_path / name
    # One process, no child: a shell forks its `sleep`, and until the fork has exec'd, the
    # copy still shows the program's name (a second "daemon" a kill of the first misses).
    program.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    program.chmod(0o755)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    started.append(subprocess.Popen([str(program)], env=env))


def test_a_daemon_is_its_process_not_a_look_alike(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    pipe = tmp_path / "pipe"
    _start(tmp_path, "not-the-daemon", pipe, processes)
    _start(tmp_path, CONTROL_PROGRAM, tmp_path / "other-pipe", processes)
    # Give both a moment to exec; neither serves this pipe folder.
    wait_for(lambda: control_daemon_running(str(tmp_path / "other-pipe")), what="a daemon")
    assert not control_daemon_running(str(pipe))
    (tmp_path / "bin").mkdir()
    _start(tmp_path / "bin", CONTROL_PROGRAM, pipe, processes)
    wait_for(lambda: control_daemon_running(str(pipe)), what="the daemon of the pipe folder")
    processes[-1].kill()
    processes[-1].wait()
    assert not control_daemon_running(str(pipe))


def test_only_the_daemons_own_fifo_is_a_control_pipe_to_write_to(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    control = pipe / "control"
    assert "does not exist" in str(control_pipe_problem(str(pipe)))
    (tmp_path / "elsewhere").write_text("")
    control.symlink_to(tmp_path / "elsewhere")
    assert "not a FIFO" in str(control_pipe_problem(str(pipe)))
    control.unlink()
    os.mkfifo(tmp_path / "fifo")
    control.symlink_to(tmp_path / "fifo")  # a link to a FIFO is still a link
    assert "not a FIFO" in str(control_pipe_problem(str(pipe)))
    control.unlink()
    os.mkfifo(control)
    assert control_pipe_problem(str(pipe)) is None
