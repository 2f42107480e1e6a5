"""Which programs ran, and for how long, from the kernel's process events.

The proc connector (a netlink socket, root only) reports every exec and exit on the machine
with the kernel's own timestamps (CLOCK_MONOTONIC, as ``time.monotonic_ns``), so timing what
a container start runs (runc create and start, each CDI hook, ldconfig) adds nothing to
those processes: no wrapper, no tracer attached. A run lasts from its exec to its exit,
children it waits for included (update-ldcache's re-exec and ldconfig are inside its hook).

    with ExecTrace(keep=lambda argv: ...) as trace:
        ...
    trace.runs  # the finished runs whose argv ``keep`` accepted

A program's name is read from /proc when its exec is reported; a program that ends before
that cannot be named and is counted in ``unnamed``. The reader therefore runs best in a
process of its own at real-time priority (``python -m bench.exec_trace``, used by
bench/pod_start.py through ``TraceProcess``), where the GIL and a loaded machine do not
delay it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

_NETLINK_CONNECTOR = 11
_CN_IDX_PROC = 1
_CN_VAL_PROC = 1
_LISTEN, _IGNORE = 1, 2
_NLMSG_DONE = 3
_PROC_EVENT_FORK = 0x00000001
_PROC_EVENT_EXEC = 0x00000002
_PROC_EVENT_EXIT = 0x80000000
_NLMSGHDR = struct.Struct("=IHHII")
_CN_MSG = struct.Struct("=IIIIHH")
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_IDS = struct.Struct("=II")  # pid (thread), tgid (process)
_RECEIVE_BUFFER = 8 << 20


class ExecTraceUnavailable(RuntimeError):
    """The proc connector cannot be opened here (not root, or no such kernel support)."""


@dataclass(frozen=True)
class Run:
    pid: int
    argv: tuple[str, ...]
    start_ns: int
    end_ns: int
    # Parent, grandparent, ... as far as forks were seen while tracing.
    ancestors: tuple[int, ...] = ()

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _cmdline(pid: int) -> tuple[str, ...]:
    """argv of ``pid``; its command name alone where argv is gone (an exiting process);
    () where neither can be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
        argv = tuple(part.decode(errors="replace") for part in raw.split(b"\0") if part)
        if argv:
            return argv
        with open(f"/proc/{pid}/comm", "rb") as f:
            return (f.read().decode(errors="replace").strip(),)
    except OSError:
        return ()


def _control(sock: socket.socket, op: int) -> None:
    payload = struct.pack("=I", op)
    message = _CN_MSG.pack(_CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(message), _NLMSG_DONE, 0, 0, os.getpid())
    sock.send(header + message)


class ExecTrace:
    """Records the runs of programs whose argv ``keep`` accepts, from ``start`` to ``stop``.
    ``lost`` counts events the kernel dropped (a full socket buffer): runs may be missing."""

    def __init__(self, keep: Callable[[tuple[str, ...]], bool]) -> None:
        self._keep = keep
        self.runs: list[Run] = []
        self.lost = 0
        self.unnamed = 0
        self._open: dict[int, tuple[tuple[str, ...], int, tuple[int, ...]]] = {}
        self._parent: dict[int, int] = {}  # process -> the process that forked it
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> ExecTrace:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
        except OSError as err:
            raise ExecTraceUnavailable(f"netlink proc connector: {err}") from None
        try:
            with_force = getattr(socket, "SO_RCVBUFFORCE", 33)
            try:
                sock.setsockopt(socket.SOL_SOCKET, with_force, _RECEIVE_BUFFER)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
            sock.bind((0, _CN_IDX_PROC))
            _control(sock, _LISTEN)
        except OSError as err:
            sock.close()
            raise ExecTraceUnavailable(
                f"listening to process events needs root (CAP_NET_ADMIN): {err}"
            ) from None
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._read, name="exec-trace", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Run]:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                _control(self._sock, _IGNORE)
            self._sock.close()
        return self.runs

    def __enter__(self) -> ExecTrace:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _read(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as err:
                if err.errno == errno.ENOBUFS:
                    self.lost += 1
                    continue
                return
            self._messages(data)

    def _messages(self, data: bytes) -> None:
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length = _NLMSGHDR.unpack_from(data, offset)[0]
            if length < _NLMSGHDR.size:
                return
            event = offset + _NLMSGHDR.size + _CN_MSG.size
            if event + _EVENT.size + 2 * _IDS.size <= offset + length:
                what, _cpu, stamp = _EVENT.unpack_from(data, event)
                pid, tgid = _IDS.unpack_from(data, event + _EVENT.size)
                if what == _PROC_EVENT_FORK:
                    # parent (pid, tgid), then child (pid, tgid)
                    child, child_tgid = _IDS.unpack_from(data, event + _EVENT.size + _IDS.size)
                    if child == child_tgid:  # a process, not a thread
                        self._parent[child_tgid] = tgid
                else:
                    self._event(what, stamp, pid, tgid)
            offset += (length + 3) & ~3

    def _event(self, what: int, stamp: int, pid: int, tgid: int) -> None:
        if what == _PROC_EVENT_EXEC:
            self._close(tgid, stamp)  # a second exec ends the first program's run
            argv = _cmdline(tgid)
            if not argv:
                self.unnamed += 1
            elif self._keep(argv):
                self._open[tgid] = (argv, stamp, self._ancestors(tgid))
        elif what == _PROC_EVENT_EXIT and pid == tgid:  # the process, not one of its threads
            self._close(tgid, stamp)
            self._parent.pop(tgid, None)

    def _ancestors(self, tgid: int) -> tuple[int, ...]:
        chain: list[int] = []
        while (parent := self._parent.get(tgid)) is not None and len(chain) < 16:
            chain.append(parent)
            tgid = parent
        return tuple(chain)

    def _close(self, tgid: int, stamp: int) -> None:
        started = self._open.pop(tgid, None)
        if started is not None:
            self.runs.append(Run(tgid, started[0], started[1], stamp, started[2]))


def keep_programs(names: Sequence[str]) -> Callable[[tuple[str, ...]], bool]:
    """Accepts an argv whose program's file name is one of ``names``."""
    wanted = frozenset(names)
    return lambda argv: os.path.basename(argv[0]) in wanted


@dataclass
class Trace:
    runs: list[Run]
    lost: int
    unnamed: int


class TraceProcess:
    """ExecTrace in a process of its own (``python -m bench.exec_trace``), at real-time
    priority where allowed; ``stop`` returns what it recorded."""

    def __init__(self, programs: Sequence[str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.exec_trace", *programs],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ready = self._proc.stdout.readline() if self._proc.stdout else ""
        if ready.strip() != "ready":
            _, err = self._proc.communicate(timeout=10)
            raise ExecTraceUnavailable(err.strip() or "the trace process did not start")

    def stop(self) -> Trace:
        self._proc.send_signal(signal.SIGTERM)
        out, err = self._proc.communicate(timeout=30)
        if self._proc.returncode != 0:
            raise ExecTraceUnavailable(f"the trace process failed: {err.strip()[-2000:]}")
        summary = json.loads(out)
        runs = [
            Run(r["pid"], tuple(r["argv"]), r["start_ns"], r["end_ns"], tuple(r["ancestors"]))
            for r in summary["runs"]
        ]
        return Trace(runs, summary["lost"], summary["unnamed"])


def main() -> int:
    parser = argparse.ArgumentParser(description="time the runs of the named programs")
    parser.add_argument("programs", nargs="+", help="program file names to record")
    args = parser.parse_args()
    # Where not allowed, ordinary priority: more programs may end before they are named.
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        trace = ExecTrace(keep_programs(args.programs)).start()
    except ExecTraceUnavailable as err:
        print(err, file=sys.stderr)
        return 1
    print("ready", flush=True)
    stop.wait()
    runs = trace.stop()
    summary = {"runs": [asdict(r) for r in runs], "lost": trace.lost, "unnamed": trace.unnamed}
    json.dump(summary, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
