"""What users wait for: pod created -> container running, for a pod with one whole GPU, on
the real node (upstream kubelet + containerd + runc, tools/node), flexgpu's plugin (the chart's
DaemonSet) against the reference driver's (sigs.k8s.io/dra-example-driver, deployed by its
own upstream Helm chart as a DaemonSet pod on the same node: tools/node/example_chart.py).

    python -m bench.pod_start [--pods 30] [--variants ...] [--mig] [--churn] [--example-on-host]

With --churn a batch starts as soon as the last one's pods (deleted without grace) and claims
have left the API, without waiting for the kubelet to unprepare them: the scheduler may give a
GPU to a new claim while the kubelet still has it prepared for the old one, as under pod churn
(a finished Job's GPU going to the next). flexgpu's prepare waits for that unprepare (up to
10 s) rather than prepare a GPU for two claims; the reference driver prepares it for both.

With --example-on-host the reference plugin runs as a plain process on the host instead (as
this benchmark ran it before): on a cgroup-v1 node that process competes for CPU as a task of
its own, while every pod (flexgpu's plugin, each container's runc init) shares the node's pod
cgroup; one run with each shows what that difference is worth.

For each driver: `--pods` pods one after another, then the same number 8 at a time. Each pod
has its own ResourceClaim for one device of the driver's DeviceClass and runs the node's
pause image; the time is from the create call returning to the first watch event showing
the container running (the scheduler's allocation, the kubelet's prepare, the sandbox and
the container start are all in it). Pods and claims are deleted between batches. Nothing is
asserted: the table shows each figure, the ratio and the target. With --mig, flexgpu alone:
pods whose claim asks for a 1g.10gb MIG partition, created on demand on GPUs 4 and 5.

Variants of flexgpu's plugin run one after another on the same node (the chart upgraded
between them), so that a reader sees what part of a gap is the CUDA payload a container
gets and what part is overhead: ``flexgpu`` as shipped (driver files; the CDI hooks in one
flexgpu-cdi-hooks call), ``separate-hooks`` (NVIDIA's hooks as five nvidia-cdi-hook calls),
``no-driver`` (no driver root: device nodes only, near the reference driver's env-only
spec) and ``example``, the reference driver. Each phase of a pod's start
(bench/pod_phases.py) is printed per variant, with the run times of runc, each CDI hook and
ldconfig from the kernel's process events (bench/exec_trace.py; needs root).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from bench.compare_table import percentile
from bench.exec_trace import ExecTraceUnavailable, Trace, TraceProcess
from bench.pod_phases import TRACED, PodTimes, ProgramTimes, program_times, read_containerd_log
from bench.pod_start_node import (
    EXAMPLE_DRIVER,
    MIG_CLASS,
    MIG_GPUS,
    MIG_GPUS_SET,
    NAMESPACE,
    NODE,
    PLUGIN_NAMESPACE,
    POD_TIMEOUT_S,
    TOPOLOGY,
    WHOLE_GPUS,
    example_class,
    roll_plugin,
    start_example,
    variant_values,
    wait_registered,
)
from bench.pod_start_report import AT_ONCE, report, rows, variant_names
from tools.cluster import ControlPlane
from tools.node import chart, example_chart
from tools.node.node import RealNode

# Reused by other benchmarks (the NVIDIA plugin's twin): keep these small and separate.
__all__ = ["AT_ONCE", "RunningSeen", "Starts", "measure", "measure_side_by_side", "rows"]

SMALL_MIG = 'device.attributes["gpu.flexgpu.dev"].profile == "1g.10gb"'
VARIANTS = ("flexgpu", "separate-hooks", "no-driver", "example")


@dataclass
class Starts:
    sequential_s: list[float] = field(default_factory=list)
    concurrent_s: list[float] = field(default_factory=list)
    # Per pod (by name): wall-clock marks of its start, from the watch and the node's log.
    times: dict[str, PodTimes] = field(default_factory=dict)
    sequential: list[str] = field(default_factory=list)
    concurrent: list[str] = field(default_factory=list)
    # Run times of runc, the CDI hooks and ldconfig, one at a time (the warm-up pod's too) and
    # 8 at once.
    programs: ProgramTimes | None = None
    programs_concurrent: ProgramTimes | None = None
    # Process events the trace lost or could not name (runs possibly missing from programs).
    untraced: int = 0


class RunningSeen:
    """Watches the namespace's pods; notes when each first shows a running container, and
    (wall clock, in ``times``) when it was bound to the node and seen running."""

    def __init__(self, api: Any) -> None:
        self._core: Any = client.CoreV1Api(api)
        self._watch = watch.Watch()
        self.at: dict[str, float] = {}
        self.times: dict[str, PodTimes] = {}
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._follow()
        except Exception as err:  # the control plane going away at the end
            print(f"pod watch ended: {type(err).__name__}", flush=True)

    def _follow(self) -> None:
        for event in self._watch.stream(self._core.list_namespaced_pod, NAMESPACE):
            pod = event["object"]
            now, wall = time.monotonic(), time.time()
            times = self.times.setdefault(pod.metadata.name, PodTimes())
            if pod.spec.node_name and math.isnan(times.bound):
                times.bound = wall
            statuses = pod.status.container_statuses or []
            if any(s.state and s.state.running for s in statuses):
                with self._changed:
                    if pod.metadata.name not in self.at:
                        self.at[pod.metadata.name] = now
                        times.running = wall
                    self._changed.notify_all()

    def wait(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not all(n in self.at for n in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [n for n in names if n not in self.at]
                    raise TimeoutError(f"pods not running after {timeout_s:.0f}s: {missing}")
                self._changed.wait(left)

    def stop(self) -> None:
        self._watch.stop()


def _claim(name: str, device_class: str, selector: str | None) -> dict[str, Any]:
    request: dict[str, Any] = {"deviceClassName": device_class, "count": 1}
    if selector is not None:
        request["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
    }


def _pod(name: str, claim: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "resources": {"claims": [{"name": "g"}]},
                }
            ],
            "resourceClaims": [{"name": "g", "resourceClaimName": claim}],
        },
    }


def _batch(
    api: Any,
    seen: RunningSeen,
    names: list[str],
    *,
    device_class: str,
    image: str,
    kubelet_state: Path | None,
    selector: str | None = None,
) -> list[float]:
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    for name in names:
        resource.create_namespaced_resource_claim(NAMESPACE, _claim(name, device_class, selector))
    created: dict[str, float] = {}

    def create(name: str) -> None:
        core.create_namespaced_pod(NAMESPACE, _pod(name, name, image))
        created[name] = time.monotonic()
        seen.times.setdefault(name, PodTimes()).created = time.time()

    threads = [threading.Thread(target=create, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen.wait(names, POD_TIMEOUT_S)
    took = [seen.at[n] - created[n] for n in names]
    for name in names:
        core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
    deadline = time.monotonic() + POD_TIMEOUT_S
    while time.monotonic() < deadline:
        left = {p.metadata.name for p in core.list_namespaced_pod(NAMESPACE).items}
        if not left & set(names):
            break
        time.sleep(0.2)
    for name in names:
        resource.delete_namespaced_resource_claim(name, NAMESPACE)
    while time.monotonic() < deadline:
        left = {c.metadata.name for c in resource.list_namespaced_resource_claim(NAMESPACE).items}
        # With no kubelet state (--churn) the next batch does not wait for the unprepare.
        drained = kubelet_state is None or not _still_prepared(kubelet_state, names)
        if not left & set(names) and drained:
            break
        time.sleep(0.2)
    return took


def _still_prepared(kubelet_state: Path, names: list[str]) -> bool:
    """Whether the kubelet still holds any of these claims as prepared (its DRA checkpoint).
    A pod deleted without grace leaves the API at once while the kubelet unprepares after:
    the next batch waits for that, or its claims could get a device still prepared for the
    last one (which flexgpu refuses until it is unprepared, and the kubelet retries later)."""
    try:
        text = kubelet_state.read_text(errors="replace")
    except FileNotFoundError:
        return False
    return any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) for name in names)


def measure(
    api: Any,
    label: str,
    *,
    device_class: str,
    image: str,
    pods: int,
    kubelet_state: Path | None,
    selector: str | None = None,
    containerd_log: Path | None = None,
) -> Starts:
    """Times ``pods`` pod starts one at a time and as many 8 at a time (measure_side_by_side
    with one driver)."""
    return measure_side_by_side(
        api,
        {label: device_class},
        image=image,
        pods=pods,
        kubelet_state=kubelet_state,
        selector=selector,
        containerd_log=containerd_log,
    )[label]


def measure_side_by_side(
    api: Any,
    drivers: dict[str, str],
    *,
    image: str,
    pods: int,
    kubelet_state: Path | None,
    selector: str | None = None,
    containerd_log: Path | None = None,
) -> dict[str, Starts]:
    """Times ``pods`` pod starts one at a time and as many 8 at a time for each driver
    (label -> DeviceClass), taking turns batch by batch, so that a machine whose load drifts
    weighs on each alike. With ``containerd_log`` (the node's), each pod's phases are read
    from it afterwards, and the runs of runc, the CDI hooks and ldconfig are traced while the
    pods start."""
    seen = RunningSeen(api)
    starts = {label: Starts() for label in drivers}

    def where(label: str) -> dict[str, Any]:
        return {
            "device_class": drivers[label],
            "image": image,
            "kubelet_state": kubelet_state,
            "selector": selector,
        }

    trace = _start_trace() if containerd_log is not None else None
    recorded = None
    try:
        for label in drivers:
            _batch(api, seen, [f"{label}-warm"], **where(label))
        for i in range(pods):
            for label, mine in starts.items():
                names = [f"{label}-s{i}"]
                mine.sequential_s += _batch(api, seen, names, **where(label))
                mine.sequential += names
        for b in range((pods + AT_ONCE - 1) // AT_ONCE):
            for label, mine in starts.items():
                names = [f"{label}-c{b}-{k}" for k in range(AT_ONCE)]
                mine.concurrent_s += _batch(api, seen, names, **where(label))
                mine.concurrent += names
        for label, mine in starts.items():
            print(f"{label}: {len(mine.sequential_s)} + {len(mine.concurrent_s)} pods", flush=True)
    finally:
        seen.stop()
        if trace is not None:
            recorded = trace.stop()
    for label, mine in starts.items():
        _fill(mine, label, seen, containerd_log, recorded)
    return starts


def _fill(
    starts: Starts,
    label: str,
    seen: RunningSeen,
    containerd_log: Path | None,
    recorded: Trace | None,
) -> None:
    """Each pod's phases from the node's log, and the traced programs of its containers."""
    # The warm-up pod too: the traced runs include its container's.
    every = [f"{label}-warm", *starts.sequential, *starts.concurrent]
    starts.times = {n: seen.times[n] for n in every if n in seen.times}
    if containerd_log is None:
        return
    containers = read_containerd_log(containerd_log, starts.times)
    if recorded is not None:
        sequential_names = {f"{label}-warm", *starts.sequential}
        starts.programs = program_times(recorded.runs, containers, sequential_names)
        starts.programs_concurrent = program_times(
            recorded.runs, containers, set(starts.concurrent)
        )
        starts.untraced = recorded.lost + recorded.unnamed


def _start_trace() -> TraceProcess | None:
    try:
        return TraceProcess(TRACED)
    except ExecTraceUnavailable as err:
        print(f"no program run times: {err}", flush=True)
        return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=30, help="pods per driver and mode")
    parser.add_argument("--mig", action="store_true", help="flexgpu alone, on-demand MIG pods")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        help=f"what to measure, in this order: {', '.join(VARIANTS)} (default: all)",
    )
    parser.add_argument(
        "--churn",
        action="store_true",
        help="start each batch as soon as the last one's pods and claims left the API, "
        "without waiting for the kubelet to unprepare them",
    )
    parser.add_argument(
        "--example-on-host",
        action="store_true",
        help="run the reference plugin as a host process, not as its chart's DaemonSet pod",
    )
    args = parser.parse_args()
    try:
        chosen = variant_names(args.variants, VARIANTS)
    except ValueError as err:
        parser.error(str(err))
    load_before = os.getloadavg()[0]
    measured: dict[str, Starts] = {}
    with ControlPlane() as plane:
        node = RealNode(plane, NODE, gpus=8, labels={"flexgpu.dev/topology": TOPOLOGY})
        node.start()
        example: subprocess.Popen[bytes] | None = None
        try:
            api = node.api
            core: Any = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": NAMESPACE}})
            image = node.images["pause"].name
            flexgpu_image = node.flexgpu_image
            chart.install(
                node,
                release="flexgpu",
                namespace=PLUGIN_NAMESPACE,
                image=flexgpu_image,
                topology=TOPOLOGY,
                extra=(
                    ("--set-string", f"kubeletPlugin.dynamicMigGpus={MIG_GPUS_SET}")
                    if args.mig
                    else WHOLE_GPUS
                ),
            )
            chart.wait_plugin_serving(node, PLUGIN_NAMESPACE, image=flexgpu_image)
            state = node.layout.kubelet_dir / "dra_manager_state"
            common = {
                "image": image,
                "pods": args.pods,
                "kubelet_state": None if args.churn else state,
                "containerd_log": node.layout.logs / "containerd.log",
            }
            if args.mig:
                mig = measure(api, "mig", device_class=MIG_CLASS, selector=SMALL_MIG, **common)
                _print_mig(mig, args.pods, load_before)
                return 0
            if "example" in chosen and args.example_on_host:
                example_class(api)
                # Outside the node's folder, which cleanup removes.
                example_log = Path(f"/tmp/{NODE}-example-plugin.log")
                example = start_example(node, plane.kubeconfig, example_log)
                print(f"example plugin log: {example_log}", flush=True)
                wait_registered(node, EXAMPLE_DRIVER)
            elif "example" in chosen:
                # The chart makes the DeviceClass gpu.example.com itself.
                example_chart.install(node)
                # Also waits for the kubelet's registration and the plugin's slices.
                pod = example_chart.wait_serving(node)
                print(f"example plugin pod: {example_chart.NAMESPACE}/{pod.metadata.name}")
            for variant in [v for v in chosen if v != "example"]:
                if variant != "flexgpu":
                    roll_plugin(node, flexgpu_image, variant_values(node, variant))
                drivers = {variant: "gpu.flexgpu.dev"}
                if "example" in chosen:
                    # The reference driver's pods take turns with this variant's.
                    drivers[f"ex-{variant}"] = EXAMPLE_DRIVER
                measured.update(measure_side_by_side(api, drivers, **common))
        finally:
            if example is not None:
                example.terminate()
                example.wait(10)
            # The node's logs outlive it, to see where a pod's start time went.
            kept = Path(f"/tmp/{NODE}-logs")
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(node.layout.logs, kept, dirs_exist_ok=True)
            shutil.copytree(node.layout.pod_logs, kept / "pods", dirs_exist_ok=True)
            print(f"node logs: {kept}", flush=True)
            node.cleanup()
    print(
        "\nPod created -> container running, one whole GPU per pod, real node (kubelet v1.37, "
        "containerd, runc), ratio = flexgpu / example\n"
    )
    where = "a host process" if args.example_on_host else "its chart's DaemonSet pod"
    print(report(measured, "ex-"))
    if "example" in chosen:
        print(f"\nThe reference plugin ran as {where}.")
    if args.churn:
        print(
            "Churn: each batch started once the last one's pods and claims had left the API, "
            "not waiting for the kubelet to unprepare them."
        )
    print(
        f"\n{args.pods} pods one at a time and {AT_ONCE * ((args.pods + AT_ONCE - 1) // AT_ONCE)}"
        f" {AT_ONCE} at a time per variant, after one warm-up pod. Load average (1 min): "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs."
    )
    return 0


def _print_mig(mig: Starts, pods: int, load_before: float) -> None:
    print(
        "\nPod created -> container running, one on-demand 1g.10gb MIG partition per pod "
        f"(created at prepare on GPUs {MIG_GPUS}), flexgpu alone, real node\n"
    )
    for label, values in (
        ("one at a time", mig.sequential_s),
        (f"{AT_ONCE} at once", mig.concurrent_s),
    ):
        print(
            f"{label}: p50 {percentile(values, 50):.2f} s, p99 {percentile(values, 99):.2f} s "
            f"({len(values)} pods)"
        )
    print("\n" + report({"mig": mig}, None))
    print(
        f"Load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, "
        f"on {os.cpu_count()} CPUs."
    )


if __name__ == "__main__":
    raise SystemExit(main())
