"""flexgpu's kubelet plugin side by side with the upstream reference driver's
(sigs.k8s.io/dra-example-driver, built by tools/example-driver/build.sh): prepare and
unprepare latency, cycles per second with 1 and 8 callers, failed calls, CPU, apiserver
requests, memory and start-up, each plugin with 8 simulated GPUs against one control plane.

    python -m bench.prepare_latency [--rounds 6] [--cycles 150] [--concurrent-cycles 40]
                                    [--starts 3]

Calls go to each plugin's DRA socket as the kubelet makes them (v1, one claim per call); each
claim is a real ResourceClaim allocated to one of that driver's devices. Rounds alternate
between the plugins (both running all along) so that machine noise hits both alike.
Nothing is asserted: the table shows each figure, the ratio and the target.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.api_meter import MetricsSnapshot, RequestCounter, plugin_identity
from bench.claims import BenchClaim, allocated_claims
from bench.compare_table import (
    Row,
    flexgpu_at_most,
    percentile,
    ratio_at_least,
    ratio_at_most,
    render,
)
from bench.load import LoadResult, run_cycles
from bench.plugins import (
    DEVICES,
    TOPOLOGY,
    RunningPlugin,
    StartFailed,
    StartTimes,
    example_binary,
    example_spec,
    flexgpu_spec,
)
from bench.procstat import cpu_seconds, memory_mib
from bench.syscalls import count_syscalls
from tools.cluster import ControlPlane, create_simulated_node

NODE = "bench-node"
NAMESPACE = "bench"
CLAIMS_PER_DEVICE = 4
WARMUP_CYCLES = 16
TRACED_CYCLES = 50
SYNC_CALLS = ("fsync", "fdatasync")


@dataclass
class Figures:
    starts: list[StartTimes] = field(default_factory=list)
    single: LoadResult = field(default_factory=LoadResult)
    eight: LoadResult = field(default_factory=LoadResult)
    cpu_s: float = 0.0
    api_requests: float = 0.0
    api_kinds: dict[str, float] = field(default_factory=dict)
    rss_mib: float = math.nan
    hwm_mib: float = math.nan
    syncs_per_cycle: float = math.nan  # fsync+fdatasync, counted apart from the rounds
    # Per round: 1-caller prepare p50 (ms), 1-caller and 8-caller cycles/s; shows the spread.
    per_round: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def cycles(self) -> int:
        return self.single.cycles + self.eight.cycles


def measure_round(
    plugin: RunningPlugin,
    claims: list[BenchClaim],
    counter: RequestCounter,
    figures: Figures,
    *,
    cycles: int,
    concurrent_cycles: int,
) -> None:
    assert plugin.stub is not None
    by_device = [[c for c in claims if c.device == d] for d in range(DEVICES)]
    before: MetricsSnapshot = counter.snapshot()
    cpu0 = cpu_seconds(plugin.pid)
    single = run_cycles(plugin.stub, [claims], cycles)
    eight = run_cycles(plugin.stub, by_device, concurrent_cycles)
    figures.cpu_s += cpu_seconds(plugin.pid) - cpu0
    figures.single.add(single)
    figures.eight.add(eight)
    figures.per_round.append(
        (percentile(single.prepare_ms, 50), single.cycles_per_s, eight.cycles_per_s)
    )
    after = counter.snapshot()
    figures.api_requests += after.requests_of(plugin.spec.identity, before)
    for kind, count in after.kinds_since(before).items():
        figures.api_kinds[kind] = figures.api_kinds.get(kind, 0.0) + count


def traced_syncs(plugin: RunningPlugin, claims: list[BenchClaim]) -> float:
    """fsync/fdatasync calls per 1-caller cycle, under strace (NaN where it cannot attach)."""
    stub = plugin.stub
    assert stub is not None
    done: list[LoadResult] = []
    counts = count_syscalls(
        plugin.pid, SYNC_CALLS, lambda: done.append(run_cycles(stub, [claims], TRACED_CYCLES))
    )
    if counts is None or not done or not done[0].cycles:
        return math.nan
    return sum(counts.values()) / done[0].cycles


def rows(flex: Figures, ref: Figures) -> list[Row]:
    def both(fn: Any, digits: int = 1, target: Any = None, name: str = "") -> Row:
        return Row(name, fn(flex), fn(ref), digits, target)

    def median_start(attr: str) -> Any:
        def median(f: Figures) -> float:
            values = [getattr(s, attr) for s in f.starts if not math.isnan(getattr(s, attr))]
            return statistics.median(values) if values else math.nan

        return median

    def per_cycle(value: Any, scale: float = 1.0) -> Any:
        return lambda f: value(f) / f.cycles * scale if f.cycles else math.nan

    return [
        both(
            lambda f: percentile(f.single.prepare_ms, 50), 2, ratio_at_most(1.2), "prepare p50 ms"
        ),
        both(lambda f: percentile(f.single.prepare_ms, 90), 2, None, "prepare p90 ms"),
        both(
            lambda f: percentile(f.single.prepare_ms, 99), 2, ratio_at_most(1.2), "prepare p99 ms"
        ),
        both(lambda f: percentile(f.single.unprepare_ms, 50), 2, None, "unprepare p50 ms"),
        both(lambda f: percentile(f.single.unprepare_ms, 99), 2, None, "unprepare p99 ms"),
        both(lambda f: percentile(f.eight.prepare_ms, 99), 2, None, "prepare p99 ms, 8 callers"),
        both(lambda f: f.single.cycles_per_s, 1, ratio_at_least(0.8), "cycles/s, 1 caller"),
        both(lambda f: f.eight.cycles_per_s, 1, ratio_at_least(0.8), "cycles/s, 8 callers"),
        both(
            lambda f: f.single.failed_calls + f.eight.failed_calls if f.cycles else math.nan,
            0,
            flexgpu_at_most(0),
            "failed calls",
        ),
        both(per_cycle(lambda f: f.cpu_s, 100), 2, ratio_at_most(1.5), "CPU s per 100 cycles"),
        both(per_cycle(lambda f: f.api_requests), 2, flexgpu_at_most(1.5), "API requests/cycle"),
        both(lambda f: f.syncs_per_cycle, 1, None, "fsyncs per cycle"),
        both(lambda f: f.rss_mib, 1, ratio_at_most(1.5), "RSS MiB (VmRSS)"),
        both(lambda f: f.hwm_mib, 1, None, "peak RSS MiB (VmHWM)"),
        both(median_start("to_socket_s"), 3, None, "exec to DRA socket s"),
        both(median_start("to_slices_s"), 3, None, "exec to slices s"),
        both(median_start("to_prepared_s"), 3, None, "exec to first claim prepared s"),
    ]


def load_average() -> str:
    """The 1-minute load average and the CPU count: other work shares the benchmark's cores."""
    return f"{Path('/proc/loadavg').read_text().split()[0]} on {os.cpu_count()} CPUs"


def explain(figures: dict[str, Figures], args: Any, load_before: str) -> None:
    flex, ref = figures["flexgpu"], figures["example"]
    print(
        f"\nMethod: {args.rounds} rounds; each round runs, per plugin in alternating order, "
        f"{args.cycles} prepare+unprepare cycles from 1 caller, then {args.concurrent_cycles} "
        f"from each of {DEVICES} callers at once (caller k on claims allocated gpu-k). "
        "Latency percentiles are from the 1-caller cycles. CPU is utime+stime of the plugin "
        "process over the measured cycles; API requests are those the apiserver dispatched "
        "for the plugin's own ServiceAccount (one FlowSchema each), watches and background "
        "work included; RSS is read after the last round. Start-up is the median of "
        f"{args.starts} starts with the driver's slices deleted first; the first real claim is "
        "prepared as soon as the socket serves, retried every 10 ms until it succeeds (the "
        "first start has an empty data directory, the others restart on it). fsyncs are "
        "counted with strace over "
        f"{TRACED_CYCLES} more 1-caller cycles after the rounds."
    )
    print(f"Machine load average (1 min): {load_before} before, {load_average()} after.")
    print(
        f"Each plugin publishes {DEVICES} simulated GPUs on one node; both run with "
        "--kube-api-qps=1000 --kube-api-burst=1000. The benchmark's own gRPC callers share "
        "the machine's cores with both plugins and the control plane."
    )
    for label, f in (("flexgpu", flex), ("example", ref)):
        starts = ", ".join(
            f"{s.to_socket_s:.3f}/{s.to_slices_s:.3f}/{s.to_prepared_s:.3f}" for s in f.starts
        )
        print(f"{label}: starts (s to socket/slices/first claim prepared): {starts}")
        rounds = ", ".join(f"{p50:.2f}/{one:.0f}/{eight:.0f}" for p50, one, eight in f.per_round)
        print(f"{label}: per round (prepare p50 ms/cycles/s 1 caller/8 callers): {rounds}")
        top = sorted(f.api_kinds.items(), key=lambda kv: -kv[1])[:6]
        if f.cycles:
            kinds = ", ".join(f"{k} {v / f.cycles:.2f}" for k, v in top)
            print(f"{label}: apiserver requests per cycle during its rounds, all clients: {kinds}")
        for error in f.single.errors + f.eight.errors:
            print(f"{label}: failed call: {error}")
        fails = f.single.failed_calls + f.eight.failed_calls
        if fails:
            print(
                f"{label}: {fails} failed calls of {2 * f.cycles} "
                f"({f.single.failed_calls} with 1 caller, {f.eight.failed_calls} with 8)"
            )


def compare(
    api: Any,
    plugins: dict[str, RunningPlugin],
    claims: dict[str, list[BenchClaim]],
    counter: RequestCounter,
    *,
    figures: dict[str, Figures],
    args: Any,
) -> None:
    """Start-up samples, warm-up, the alternating rounds, then memory and fsync counts. A
    plugin that fails to start is left out from then on; its figures read n/a."""
    order = list(plugins)
    down: set[str] = set()
    for i in range(args.starts):
        for label in order if i % 2 == 0 else reversed(order):
            if label in down:
                continue
            plugins[label].stop()
            try:
                started = plugins[label].start(api, NODE, claims[label][0])
                figures[label].starts.append(started)
            except StartFailed as err:
                print(f"{label}: did not start, left out: {err}", flush=True)
                down.add(label)
    up = [label for label in order if label not in down]
    for label in up:
        stub = plugins[label].stub
        assert stub is not None
        warm = run_cycles(stub, [claims[label]], WARMUP_CYCLES)
        first = f" (first error: {warm.errors[0]})" if warm.errors else ""
        print(f"{label}: warm-up {warm.cycles_ok}/{warm.cycles} cycles ok{first}", flush=True)
    for r in range(args.rounds):
        for label in up if r % 2 == 0 else reversed(up):
            measure_round(
                plugins[label],
                claims[label],
                counter,
                figures[label],
                cycles=args.cycles,
                concurrent_cycles=args.concurrent_cycles,
            )
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for label in up:
        plugin = plugins[label]
        figures[label].rss_mib = memory_mib(plugin.pid, "VmRSS")
        figures[label].hwm_mib = memory_mib(plugin.pid, "VmHWM")
        figures[label].syncs_per_cycle = traced_syncs(plugin, claims[label])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cycles", type=int, default=150, help="1-caller cycles per round")
    parser.add_argument(
        "--concurrent-cycles", type=int, default=40, help="cycles per caller per 8-caller round"
    )
    parser.add_argument("--starts", type=int, default=3, help="start-up samples per plugin")
    args = parser.parse_args()

    binary = example_binary()
    load_before = load_average()
    figures = {"flexgpu": Figures(), "example": Figures()}
    root = Path(tempfile.mkdtemp(prefix="fgcmp-", dir="/tmp"))
    # CDI specs on tmpfs as on a node (/var/run is tmpfs); checkpoints on disk, for both.
    cdi = Path(tempfile.mkdtemp(prefix="fgcmp-", dir="/dev/shm"))
    with ControlPlane() as plane:
        api = plane.api_client()
        create_simulated_node(api, NODE)
        core: Any = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        specs = {
            "flexgpu": flexgpu_spec(
                root / "flexgpu",
                plugin_identity(
                    api, plane.kubeconfig, NAMESPACE, "flexgpu-plugin", root / "flexgpu.kubeconfig"
                ),
                NODE,
                cdi / "flexgpu",
            ),
            "example": example_spec(
                binary,
                root / "example",
                plugin_identity(
                    api, plane.kubeconfig, NAMESPACE, "example-plugin", root / "example.kubeconfig"
                ),
                NODE,
                cdi / "example",
            ),
        }
        claims = {
            label: allocated_claims(
                api,
                NAMESPACE,
                prefix=label,
                driver=spec.driver,
                device_class=spec.device_class,
                pool=NODE,
                devices=DEVICES,
                per_device=CLAIMS_PER_DEVICE,
            )
            for label, spec in specs.items()
        }
        counter = RequestCounter(plane.server, plane.kubeconfig)
        plugins = {
            label: RunningPlugin(spec, root / f"{label}.log") for label, spec in specs.items()
        }
        try:
            compare(api, plugins, claims, counter, figures=figures, args=args)
        finally:
            for plugin in plugins.values():
                plugin.stop()
    print(
        "\nflexgpu kubelet plugin vs sigs.k8s.io/dra-example-driver v0.4.0 kubelet plugin, "
        f"{DEVICES} simulated GPUs each (flexgpu: {TOPOLOGY} with MIG off), one control "
        "plane, ratio = flexgpu / example\n"
    )
    print(render(rows(figures["flexgpu"], figures["example"])))
    explain(figures, args, load_before)
    failed = [label for label, f in figures.items() if len(f.starts) < args.starts]
    if failed:
        # Figures of a plugin that did not start are n/a: the run measured nothing for it.
        print(f"FAILED: {', '.join(failed)} did not start every time (see above)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
