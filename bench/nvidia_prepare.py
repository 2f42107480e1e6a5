"""flexgpu's kubelet plugin side by side with NVIDIA's own (sigs.k8s.io/dra-driver-nvidia-gpu
v0.4.1, built by tools/nvidia-driver/build.sh), both on the NVML backend over the same NVML mock
machine (a DGX H100, eight whole GPUs) and driver root: prepare and unprepare latency, cycles
per second with 1 and 8 callers, failed calls, CPU, apiserver requests, memory and start-up.

    python -m bench.nvidia_prepare [--rounds 4] [--cycles 100] [--concurrent-cycles 25]
                                   [--starts 2] [--mig]

The method is bench.prepare_latency's (same rounds, same figures, same table); only the
competitor differs. NVIDIA's plugin runs with its chart's feature gates (none), and both write
CDI specs that carry the driver root's libraries and programs. With ``--mig`` each claim is a
1g.10gb partition at placement 0 of its GPU, made in prepare and destroyed in unprepare:
NVIDIA's plugin with DynamicMIG, flexgpu's with --dynamic-mig-gpus=all and binding conditions
off (so the partition is made in prepare, as NVIDIA makes it). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.api_meter import RequestCounter, plugin_identity
from bench.claims import allocated_claims
from bench.compare_table import percentile, render
from bench.plugins import DEVICES, PluginSpec, RunningPlugin
from bench.prepare_latency import (
    CLAIMS_PER_DEVICE,
    NAMESPACE,
    NODE,
    Figures,
    compare,
    load_average,
    rows,
)
from tests.nvidia_ctk import tools_dir
from tests.nvml_library import MockMachine, library_dir
from tools.cluster import ControlPlane, create_simulated_node
from tools.node import driver_root
from tools.nvidia_twin import DYNAMIC_MIG_GATES, NVIDIA_DRIVER, nvidia_plugin_binary
from tools.nvidia_twin.node_plugin import with_proc_view

MACHINE: dict[str, Any] = {
    "machine": "dgxh100",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "addressingMode": "HMM",
}


def _machine_copy(base: Path, label: str) -> MockMachine:
    """One machine description, a state file per plugin."""
    config = base / "nvml-machine.json"
    if not config.exists():
        base.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(MACHINE))
    return MockMachine(config_path=config, state_path=base / f"{label}-state.json")


# --mig: the partition every claim gets, as each plugin names it (NVIDIA puts the profile id,
# 19 for 1g.10gb, before the placement start).
MIG_PROFILE, MIG_PROFILE_ID, MIG_START = "1g10gb", 19, 0


def flexgpu_nvml_spec(
    root: Path,
    kubeconfig: Path,
    *,
    cdi: Path,
    driver: Path,
    hook: Path,
    machine: MockMachine,
    mig: bool = False,
) -> PluginSpec:
    return PluginSpec(
        label="flexgpu",
        driver="gpu.flexgpu.dev",
        device_class="mig.flexgpu.dev" if mig else "gpu.flexgpu.dev",
        identity="flexgpu-plugin",
        argv=(
            sys.executable,
            "-m",
            "flexgpu.kubelet_plugin.main",
            "--gpu-backend=nvml",
            f"--node-name={NODE}",
            f"--kubeconfig={kubeconfig}",
            f"--registry-dir={root}/reg",
            f"--plugins-dir={root}/plugins",
            f"--cdi-dir={cdi}",
            f"--data-dir={root}/data",
            f"--driver-root={driver}",
            f"--nvidia-cdi-hook={hook}",
            *(("--dynamic-mig-gpus=all", "--binding-conditions=off") if mig else ()),
        ),
        socket=root / "plugins" / "gpu.flexgpu.dev" / "dra.sock",
        kubelet_dirs=(root / "reg", root / "plugins"),
        env={
            **os.environ,
            **machine.env(),
            "PATH": f"{hook.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        },
    )


def nvidia_spec(
    binary: Path,
    root: Path,
    kubeconfig: Path,
    *,
    cdi: Path,
    driver: Path,
    hook: Path,
    machine: MockMachine,
    mig: bool = False,
) -> PluginSpec:
    env = machine.env()
    env.pop("LD_LIBRARY_PATH", None)  # it opens the driver root's libnvidia-ml.so.1 by path
    argv: tuple[str, ...] = (
        str(binary),
        f"--node-name={NODE}",
        f"--kubeconfig={kubeconfig}",
        f"--cdi-root={cdi}",
        f"--nvidia-driver-root={driver}",
        f"--container-driver-root={driver}",
        f"--nvidia-cdi-hook-path={hook}",
        "--image-name=registry.k8s.io/dra-driver-nvidia-gpu/dra-driver-nvidia-gpu:v0.4.1",
        f"--kubelet-registrar-directory-path={root}/reg",
        f"--kubelet-plugins-directory-path={root}/plugins",
        # client-go's default (5 qps, burst 10) would throttle its claim reads: measure
        # the driver, not the limiter (as the example driver is run).
        "--kube-api-qps=1000",
        "--kube-api-burst=1000",
    )
    if mig:
        # A MIG device's CDI edits need the capability files a loaded kernel module shows
        # under /proc: the plugin sees the driver root's (tools/nvidia_twin/node_plugin.py).
        argv = (*argv, f"--feature-gates={DYNAMIC_MIG_GATES}")
        argv = tuple(with_proc_view(driver, root / "proc", argv))
    return PluginSpec(
        label="nvidia",
        driver=NVIDIA_DRIVER,
        device_class="mig.nvidia.com" if mig else NVIDIA_DRIVER,
        identity="nvidia-plugin",
        argv=argv,
        socket=root / "plugins" / NVIDIA_DRIVER / "dra.sock",
        kubelet_dirs=(root / "reg", root / "plugins"),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), **env},
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=100, help="1-caller cycles per round")
    parser.add_argument(
        "--concurrent-cycles", type=int, default=25, help="cycles per caller per 8-caller round"
    )
    parser.add_argument("--starts", type=int, default=2, help="start-up samples per plugin")
    parser.add_argument(
        "--mig", action="store_true", help="claims for 1g.10gb partitions made on demand"
    )
    args = parser.parse_args()
    names = {
        "flexgpu": lambda gpu: f"gpu-{gpu}-mig-{MIG_PROFILE}-{MIG_START}",
        "nvidia": lambda gpu: f"gpu-{gpu}-mig-{MIG_PROFILE}-{MIG_PROFILE_ID}-{MIG_START}",
    }

    binary = nvidia_plugin_binary()
    hook = tools_dir() / "nvidia-cdi-hook"
    load_before = load_average()
    figures = {"flexgpu": Figures(), "nvidia": Figures()}
    root = Path(tempfile.mkdtemp(prefix="fgnv-", dir="/tmp"))
    cdi = Path(tempfile.mkdtemp(prefix="fgnv-", dir="/dev/shm"))
    made = driver_root.create(root / "driver", DEVICES, library_dir() / "libnvidia-ml.so.1")
    if args.mig:
        driver_root.add_mig_capabilities(made)  # MIG devices' capability nodes
    driver = made.root
    try:
        with ControlPlane() as plane:
            api = plane.api_client()
            create_simulated_node(api, NODE)
            core: Any = client.CoreV1Api(api)
            core.create_namespace({"metadata": {"name": NAMESPACE}})

            def identity(name: str) -> Path:
                return plugin_identity(
                    api, plane.kubeconfig, NAMESPACE, name, root / f"{name}.kubeconfig"
                )

            specs = {
                "flexgpu": flexgpu_nvml_spec(
                    root / "flexgpu",
                    identity("flexgpu-plugin"),
                    cdi=cdi / "flexgpu",
                    driver=driver,
                    hook=hook,
                    machine=_machine_copy(root / "machine", "flexgpu"),
                    mig=args.mig,
                ),
                "nvidia": nvidia_spec(
                    binary,
                    root / "nvidia",
                    identity("nvidia-plugin"),
                    cdi=cdi / "nvidia",
                    driver=driver,
                    hook=hook,
                    machine=_machine_copy(root / "machine", "nvidia"),
                    mig=args.mig,
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
                    **({"device_name": names[label]} if args.mig else {}),
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
    finally:
        shutil.rmtree(cdi, ignore_errors=True)
    what = (
        f"{DEVICES} GPUs, each claim a 1g.10gb partition made in prepare"
        if args.mig
        else f"{DEVICES} whole GPUs"
    )
    print(
        "\nflexgpu kubelet plugin vs NVIDIA's DRA kubelet plugin v0.4.1, both on NVML over the "
        f"same mock DGX H100 ({what}), one control plane, ratio = flexgpu / NVIDIA\n"
    )
    print(render(rows(figures["flexgpu"], figures["nvidia"]), reference="nvidia"))
    print(
        f"\nMethod: as bench.prepare_latency ({args.rounds} rounds of {args.cycles} 1-caller "
        f"cycles and {args.concurrent_cycles} cycles from each of {DEVICES} callers, "
        f"alternating; start-up the median of {args.starts}). Targets are the ones set against "
        "the reference driver. Both plugins read GPUs through NVML (the mock library) and "
        "write CDI specs with the driver root's libraries; NVIDIA's runs with --kube-api-qps="
        "1000 --kube-api-burst=1000 and "
        + (
            f"--feature-gates={DYNAMIC_MIG_GATES}, flexgpu's with --dynamic-mig-gpus=all "
            "--binding-conditions=off."
            if args.mig
            else "no feature gates (its chart's default)."
        )
    )
    print(f"Machine load average (1 min): {load_before} before, {load_average()} after.")
    for label, f in figures.items():
        latency = ", ".join(
            f"{n} {percentile(r.prepare_ms, 50):.2f}/{percentile(r.prepare_ms, 99):.2f}"
            for n, r in (("1 caller", f.single), (f"{DEVICES} callers", f.eight))
        )
        print(f"{label}: prepare p50/p99 ms: {latency}")
        starts = ", ".join(
            f"{s.to_socket_s:.3f}/{s.to_slices_s:.3f}/{s.to_prepared_s:.3f}" for s in f.starts
        )
        print(f"{label}: starts (s to socket/slices/first claim prepared): {starts}")
        rounds = ", ".join(f"{p50:.2f}/{one:.0f}/{eight:.0f}" for p50, one, eight in f.per_round)
        print(f"{label}: per round (prepare p50 ms/cycles/s 1 caller/8 callers): {rounds}")
        for error in (f.single.errors + f.eight.errors)[:5]:
            print(f"{label}: failed call: {error}")
    print(f"Logs and state: {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
