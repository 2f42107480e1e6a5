"""`python -m tools.cluster up|down|status`: a long-lived local control plane for people.

`up` starts a supervisor in the background that owns the components (they die with it),
waits until the cluster is ready and prints where the kubeconfig and logs are."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from tools.cluster.binaries import REPO_ROOT
from tools.cluster.supervisor import stop_supervisor, supervisor_pid

DEFAULT_DIR = REPO_ROOT / ".run" / "cluster"


def serve(workdir: Path) -> int:
    from tools.cluster.control_plane import ControlPlane

    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    (workdir / "ready").unlink(missing_ok=True)
    plane = ControlPlane(workdir=workdir)
    plane.start()
    (workdir / "ready").write_text(plane.version + "\n" + plane.feature_gates + "\n")
    try:
        while not stop:
            time.sleep(0.5)
            plane.check_running()
    finally:
        plane.stop()
        (workdir / "ready").unlink(missing_ok=True)
    return 0


def up(workdir: Path) -> int:
    if supervisor_pid(workdir):
        print(f"cluster already running; KUBECONFIG={workdir / 'kubeconfig'}")
        return 0
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("etcd", "logs", "ready"):
        target = workdir / stale
        if target.is_dir():
            subprocess.run(["rm", "-rf", str(target)], check=False)
        else:
            target.unlink(missing_ok=True)
    # Building (on a cold cache) prints progress here, before the supervisor detaches.
    from tools.cluster.binaries import control_plane_dir

    control_plane_dir()
    log = (workdir / "supervisor.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cluster", "serve", "--workdir", str(workdir)],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (workdir / "supervisor.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (workdir / "ready").exists():
            version = (workdir / "ready").read_text().splitlines()[0]
            print(f"local control plane is up ({version})")
            print(f"  export KUBECONFIG={workdir / 'kubeconfig'}")
            print(f"  logs: {workdir / 'logs'}/")
            return 0
        if proc.poll() is not None:
            print(f"cluster failed to start; see {workdir / 'supervisor.log'}:", file=sys.stderr)
            print((workdir / "supervisor.log").read_text()[-3000:], file=sys.stderr)
            return 1
        time.sleep(0.3)
    print("cluster did not become ready within 300s", file=sys.stderr)
    return 1


def down(workdir: Path) -> int:
    print("cluster stopped" if stop_supervisor(workdir) else "cluster is not running")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cluster")
    parser.add_argument("command", choices=["up", "down", "status", "serve"])
    parser.add_argument("--workdir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    if args.command == "serve":
        return serve(workdir)
    if args.command == "up":
        return up(workdir)
    if args.command == "down":
        return down(workdir)
    running = supervisor_pid(workdir) is not None and (workdir / "ready").exists()
    print(f"running, KUBECONFIG={workdir / 'kubeconfig'}" if running else "not running")
    return 0 if running else 1


if __name__ == "__main__":
    sys.exit(main())
