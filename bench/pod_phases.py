"""Where a pod's start goes, phase by phase, from what the node itself records.

The pod watch gives when a pod was created, bound to the node and seen running; containerd's
CRI log (info level) gives when the kubelet asked for the pod's sandbox, its container and
the container's start, and when each call returned; the kernel's process events
(bench/exec_trace.py) give how long each runc call, CDI hook and ldconfig ran. Phases:

- bind: created -> the pod bound to the node (the scheduler's allocation of the claim);
- kubelet + prepare: bound -> RunPodSandbox asked (the kubelet's pod worker and its
  NodePrepareResources call to the DRA plugin, which comes before the sandbox);
- sandbox: RunPodSandbox (pause container, network);
- container config: sandbox ready -> CreateContainer asked;
- create: CreateContainer (containerd's CDI injection into the OCI spec);
- start: StartContainer (runc create, with the CDI hooks, and runc start);
- seen running: started -> the watch shows the container running (kubelet status update).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.compare_table import percentile
from bench.exec_trace import Run

PHASES = (
    "bind",
    "kubelet + prepare",
    "sandbox",
    "container config",
    "create",
    "start",
    "seen running",
)
# Programs timed at each container start (exec_trace keeps these by file name).
TRACED = ("runc", "nvidia-cdi-hook", "flexgpu-cdi-hooks", "ldconfig", "ldconfig.real")

_LINE = re.compile(r'time="(?P<time>[^"]+)".*?msg="(?P<msg>(?:[^"\\]|\\.)*)"')
# The pod's metadata as containerd prints it: protobuf text (2.x: name:"p"  uid:...) or a Go
# struct (&PodSandboxMetadata{Name:p,...}); some releases spell the first "RunPodsandbox".
_POD = r'(?:&PodSandboxMetadata\{Name:(?P<pod>[^,]+),|name:"(?P<pod_>[^"]+)")'
_SANDBOX_ASKED = re.compile(rf"^RunPod[Ss]andbox for {_POD}")
_SANDBOX_DONE = re.compile(rf'^RunPodSandbox for {_POD}.*returns sandbox id "(?P<sandbox>\w+)"')
_CREATE_ASKED = re.compile(r'^CreateContainer within sandbox "(?P<sandbox>\w+)" for container ')
_CREATE_DONE = re.compile(
    r'^CreateContainer within sandbox "(?P<sandbox>\w+)" for .* returns container id '
    r'"(?P<container>\w+)"'
)
_START_ASKED = re.compile(r'^StartContainer for "(?P<container>\w+)"$')
_START_DONE = re.compile(r'^StartContainer for "(?P<container>\w+)" returns successfully')


@dataclass
class PodTimes:
    """Wall-clock times (seconds since the epoch) of one pod's start; NaN where not seen."""

    created: float = math.nan
    bound: float = math.nan
    running: float = math.nan
    sandbox_asked: float = math.nan
    sandbox_done: float = math.nan
    create_asked: float = math.nan
    create_done: float = math.nan
    start_asked: float = math.nan
    start_done: float = math.nan

    def phases(self) -> dict[str, float]:
        marks = [
            self.created,
            self.bound,
            self.sandbox_asked,
            self.sandbox_done,
            self.create_asked,
            self.create_done,
            self.start_asked,
            self.start_done,
            self.running,
        ]
        spans = [b - a for a, b in itertools.pairwise(marks)]
        # create_done -> start_asked (the kubelet between two CRI calls) counts with start.
        merged = [*spans[:5], spans[5] + spans[6], spans[7]]
        return dict(zip(PHASES, merged, strict=True))


def _wall(stamp: str) -> float:
    """An RFC 3339 time with up to nanoseconds, as containerd logs it, in epoch seconds."""
    head, dot, rest = stamp.partition(".")
    if dot:
        digits = re.match(r"\d*", rest)
        fraction = digits.group(0) if digits else ""
        zone = rest[len(fraction) :]
        stamp = f"{head}.{(fraction + '000000')[:6]}{zone}"
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _messages(lines: Iterable[str]) -> Iterable[tuple[float, str]]:
    for line in lines:
        match = _LINE.search(line)
        if match:
            message = match["msg"].replace('\\"', '"').replace("\\\\", "\\")
            yield _wall(match["time"]), message


def read_containerd_log(path: Path, pods: Mapping[str, PodTimes]) -> dict[str, str]:
    """Fills the CRI times of ``pods`` (by pod name) from containerd's log; returns the ids
    of those pods' containers, sandboxes left out (container id -> pod name)."""
    owner: dict[str, str] = {}  # sandbox and container ids -> pod name
    containers: dict[str, str] = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return containers
    for at, message in _messages(lines):
        if match := _SANDBOX_DONE.match(message):
            pod = match["pod"] or match["pod_"]
            if pod in pods:
                pods[pod].sandbox_done = at
                owner[match["sandbox"]] = pod
        elif match := _SANDBOX_ASKED.match(message):
            pod = match["pod"] or match["pod_"]
            if pod in pods:
                pods[pod].sandbox_asked = at
        elif match := _CREATE_DONE.match(message):
            if match["sandbox"] in owner:
                pods[owner[match["sandbox"]]].create_done = at
                owner[match["container"]] = owner[match["sandbox"]]
                containers[match["container"]] = owner[match["sandbox"]]
        elif match := _CREATE_ASKED.match(message):
            if match["sandbox"] in owner:
                pods[owner[match["sandbox"]]].create_asked = at
        elif match := _START_DONE.match(message):
            if match["container"] in owner:
                pods[owner[match["container"]]].start_done = at
        elif (match := _START_ASKED.match(message)) and match["container"] in owner:
            pods[owner[match["container"]]].start_asked = at
    return containers


def phase_medians(pods: Iterable[PodTimes]) -> dict[str, float]:
    """Each phase's median over ``pods`` (pods where a phase was not seen are left out)."""
    spans: dict[str, list[float]] = {name: [] for name in PHASES}
    for times in pods:
        for name, value in times.phases().items():
            if not math.isnan(value):
                spans[name].append(value)
    return {f"{name} s": percentile(values, 50) for name, values in spans.items()}


@dataclass
class ProgramTimes:
    """Runs of the traced programs at container starts, by kind."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds.setdefault(kind, []).append(seconds)


def _runc_call(argv: Sequence[str]) -> str | None:
    for arg in argv[1:]:
        if arg in {"create", "start", "delete", "kill", "state", "init", "features"}:
            return arg
    return None


def program_times(
    runs: Iterable[Run], containers: Mapping[str, str], pods: Collection[str] | None = None
) -> ProgramTimes:
    """Groups the runs that belong to the pods' containers (ids in ``containers``; of
    ``pods`` alone when given): ``runc create``/``runc start`` of those containers, and what
    those runc calls started (each CDI hook by its subcommand, ``flexgpu-cdi-hooks`` as one,
    ldconfig). Sandboxes, and the containers of other nodes on the machine, are left out."""
    runs = list(runs)
    owner: dict[int, str] = {}  # pid of a runc create/start of a pod's container -> the pod
    for run in runs:
        ours = run.argv and run.argv[-1] in containers
        if (
            ours
            and os.path.basename(run.argv[0]) == "runc"
            and _runc_call(run.argv)
            in {
                "create",
                "start",
            }
        ):
            owner[run.pid] = containers[run.argv[-1]]
    times = ProgramTimes()
    for run in runs:
        pod = owner.get(run.pid) or next((owner[a] for a in run.ancestors if a in owner), None)
        if pod is None or (pods is not None and pod not in pods):
            continue
        program = os.path.basename(run.argv[0]) if run.argv else ""
        if program == "runc":
            # Only the create/start calls themselves (a reused pid could name another call).
            call = _runc_call(run.argv)
            if run.pid in owner and call in {"create", "start"}:
                times.add(f"runc {call}", run.seconds)
        elif program == "nvidia-cdi-hook":
            name = next((a for a in run.argv[1:] if not a.startswith("-")), "?")
            times.add(f"hook {name}", run.seconds)
        elif program == "flexgpu-cdi-hooks":
            times.add(f"hook flexgpu-cdi-hooks ({len(run.argv) - 1} hooks)", run.seconds)
        elif program.startswith("ldconfig"):
            times.add("ldconfig (in update-ldcache)", run.seconds)
    return times


def render_phases(
    columns: Mapping[str, Mapping[str, float]], digits: int = 3, heading: str = "figure (p50)"
) -> str:
    """A Markdown table: one row per figure, one column per variant."""
    names = list(columns)
    rows = [(heading, *names)]
    keys: list[str] = []
    for values in columns.values():
        keys += [k for k in values if k not in keys]
    for key in keys:
        cells = []
        for name in names:
            value = columns[name].get(key, math.nan)
            cells.append("-" if math.isnan(value) else f"{value:.{digits}f}")
        rows.append((key, *cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            row[0].ljust(widths[0]),
            *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def program_medians(times: ProgramTimes, containers: int) -> dict[str, float]:
    """Per kind: the median run in ms and the runs per container started."""
    out: dict[str, float] = {}
    for kind, values in sorted(times.seconds.items()):
        out[f"{kind} ms"] = percentile(values, 50) * 1000
        out[f"{kind}: runs per container"] = len(values) / containers if containers else math.nan
    return out
