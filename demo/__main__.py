"""`make demo`: a local Kubernetes 1.37 cluster with flexgpu installed by its Helm chart,
three simulated GPU nodes and, where this machine allows, one real node (demo/real_node.py),
and the workload catalog in this folder, with a table of what
each pod got, then `flexgpu usage` once the workloads ran a while (one claim kept idle).
`make demo-down` (``python -m demo down``) stops everything.

A background supervisor (``python -m demo serve``) owns the control plane, the controller
and the nodes, so they keep running after `make demo` returns; a second `make demo` reuses
them and only runs the catalog again.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from kubernetes import config

from demo import catalog, real_node, usage
from demo.world import NODES, DemoWorld, container_seen, plugin_endpoints
from tools.cluster.binaries import REPO_ROOT, control_plane_dir, helm_tools_dir
from tools.cluster.control_plane import ControlPlane
from tools.cluster.supervisor import stop_supervisor, supervisor_pid

WORKDIR = REPO_ROOT / ".run" / "demo"
NODE_ROOT = Path("/tmp/flexgpu-demo")


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def serve() -> int:
    """Runs until SIGTERM: control plane, chart, controller, nodes (all die with us)."""
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    plane = ControlPlane(workdir=WORKDIR / "cluster")
    plane.start()
    world = DemoWorld(plane.kubeconfig, WORKDIR, node_root=NODE_ROOT, cluster=plane)
    try:
        world.start()
        (WORKDIR / "ready").write_text(plane.version + "\n")
        while not stop:
            time.sleep(0.5)
    finally:
        (WORKDIR / "ready").unlink(missing_ok=True)
        world.stop()
        plane.stop()
    return 0


def ensure_running() -> Path:
    kubeconfig = WORKDIR / "cluster" / "kubeconfig"
    if supervisor_pid(WORKDIR) and (WORKDIR / "ready").exists():
        print(f"reusing the running demo cluster ({kubeconfig})")
        return kubeconfig
    WORKDIR.mkdir(parents=True, exist_ok=True)
    for stale in ("ready", "supervisor.pid"):
        (WORKDIR / stale).unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", str(WORKDIR / "cluster")], check=False)
    step("building or finding the Kubernetes v1.37 control plane, helm and kubectl")
    control_plane_dir()
    helm_tools_dir()
    step(
        "starting the control plane, installing the chart, starting the controller and "
        "three simulated GPU nodes (plugin + kubelet harness each) and one real node "
        "(kubelet + containerd + runc, the plugin as the chart's DaemonSet pod)"
    )
    log = (WORKDIR / "supervisor.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo", "serve"],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (WORKDIR / "supervisor.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 600
    while not (WORKDIR / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (WORKDIR / "supervisor.log").read_text()[-4000:]
            raise SystemExit(
                f"the demo cluster did not start; {WORKDIR / 'supervisor.log'}:\n{tail}"
            )
        time.sleep(0.5)
    for name, topology, flags in NODES:
        print(f"  {name}: {topology} {' '.join(flags)}".rstrip() + " (kubelet harness)")
    real = real_node.read_state(WORKDIR)
    if "skipped" in real:
        print(f"  no real node: {real['skipped']}")
    else:
        print(f"  {real_node.NAME}: {real_node.TOPOLOGY} (real kubelet, containerd and runc)")
    return kubeconfig


def up() -> int:
    kubeconfig = ensure_running()
    api = config.new_client_from_config(config_file=str(kubeconfig))
    step(f"applying the workload catalog to namespace {catalog.NAMESPACE}")
    catalog.reset_namespace(api)
    for manifest in catalog.manifests():
        first = manifest.read_text().splitlines()[0].lstrip("# ")
        catalog.apply(api, manifest)
        print(f"  {manifest.name}: {first}")
    real = real_node.read_state(WORKDIR)
    if "image" in real:
        real_node.apply(api, real["image"])
        pods = ", ".join(f"{p} ({n} GPU{'s' if n > 1 else ''})" for p, n in real_node.PODS)
        print(f"  on {real_node.NAME}, the workload image reporting from inside: {pods}")

    step("waiting for the scheduler, the plugins and the containers")

    def seen_of(node: str, pod: str) -> catalog.Seen:
        if node == real_node.NAME and "podLogs" in real:
            return real_node.container_seen(Path(real["podLogs"]), pod)
        return container_seen(NODE_ROOT, node, catalog.NAMESPACE, pod)

    started = time.monotonic()
    rows = catalog.wait_settled(api, seen_of)
    print(catalog.table(rows))
    step(f"why {catalog.UNSATISFIABLE} is still pending (the controller's Event)")
    explanation = catalog.explanation(api)
    print(
        "  "
        + (
            explanation
            or "(no explanation yet; try: flexgpu explain "
            f"{catalog.NAMESPACE}/{catalog.UNSATISFIABLE})"
        )
    )
    step(
        f"simulated load on every claim but {usage.IDLE_POD}'s; `flexgpu usage` once that "
        f"claim has been idle for {usage.IDLE_WINDOW}"
    )
    roots = {name: NODE_ROOT / name for name, _, _ in NODES}
    idle = usage.apply_load(api, roots)
    report = usage.wait_idle_listed(plugin_endpoints(WORKDIR), kubeconfig, idle)
    print("\n".join("  " + line for line in report.splitlines()))
    print(f"  (catalog settled and usage shown in {time.monotonic() - started:.0f}s)")
    print(f"""
The cluster keeps running. Try:
  export KUBECONFIG={kubeconfig}
  {helm_tools_dir() / "kubectl"} get resourceslices
  {helm_tools_dir() / "kubectl"} -n {catalog.NAMESPACE} get resourceclaims
  .venv/bin/flexgpu capacity
  .venv/bin/flexgpu explain {catalog.NAMESPACE}/{catalog.UNSATISFIABLE}
  .venv/bin/flexgpu usage -o wide --idle-window={usage.IDLE_WINDOW} \\
      {" ".join(f"--plugin={e}" for e in plugin_endpoints(WORKDIR))}
Logs: {WORKDIR / "logs"}/, {NODE_ROOT}/<node>/logs/ and {WORKDIR / "supervisor.log"}
Stop it with: make demo-down""")
    settled = all(r.phase == "Running" for r in rows if r.pod != catalog.UNSATISFIABLE)
    idle_listed = bool(idle) and all(c in report.partition("Idle claims:")[2] for c in idle)
    return 0 if settled and explanation and idle_listed else 1


def down() -> int:
    print("demo stopped" if stop_supervisor(WORKDIR) else "the demo is not running")
    return 0


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "up"
    return {"up": up, "serve": serve, "down": down}[command]()


if __name__ == "__main__":
    sys.exit(main())
