"""``flexgpu doctor``: preflight before workloads fail.

``flexgpu doctor`` checks the cluster (release, DRA gates, nodes both NVIDIA's device plugin and
flexgpu serve, GPU nodes without a plugin, each node's own verdict); ``flexgpu doctor node``
checks the node it runs on (driver root and version, runtime CDI, the CDI hook, a device plugin,
GPUs in MIG mode). The chart runs the node part as the plugin pod's init container, which prints
the table to its log and, with ``--record-event``, records the verdict as an Event on its Node.
Exit status 0 when nothing failed (warnings allowed), 5 when a check failed.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kubernetes import client

from flexgpu.controller.cli_options import (
    CliError,
    ExitCode,
    add_cluster_options,
    call,
    connect,
    emit,
)
from flexgpu.controller.doctor_cluster import cluster_checks
from flexgpu.driver.inventory import NodeInventory, collect_inventory
from flexgpu.driver.preflight import Check, NodeFacts, Status, find_nvml, node_checks, worst

EVENT_SOURCE: Final = "flexgpu-preflight"


def checks_table(checks: Sequence[Check]) -> str:
    rows = [("CHECK", "STATUS", "DETAIL"), *((c.name, c.status.value, c.detail) for c in checks)]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{r[0]:<{width[0]}}   {r[1]:<{width[1]}}   {r[2]}" for r in rows)


def _report(checks: Sequence[Check], output: str | None) -> int:
    verdict = worst(checks)
    if output:
        emit(
            {
                "verdict": verdict.value,
                "checks": [
                    {"name": c.name, "status": c.status.value, "detail": c.detail} for c in checks
                ],
            },
            output,
        )
    else:
        print(checks_table(checks))
    return ExitCode.CHECK_FAILED if verdict is Status.FAIL else ExitCode.OK


def _read_inventory(driver_root: Path | None, topology: str | None) -> Any:
    """A function that reads the GPUs without changing anything, or None without NVML."""
    if topology:
        from flexgpu.driver.sim_backend import SimulatedBackend

        def simulated() -> NodeInventory:
            with SimulatedBackend.from_topology(topology, "doctor", None) as backend:
                return collect_inventory(backend)

        return simulated
    if driver_root is None:
        return None

    def nvml() -> NodeInventory:
        import pynvml

        from flexgpu.driver.nvml_backend import NvmlBackend
        from flexgpu.driver.nvml_readonly import ReadOnlyNvml
        from flexgpu.driver.readonly_backend import ReadOnlyBackend

        library = find_nvml(driver_root)
        if library is not None:
            # By path, so that pynvml's load by name finds this driver's library.
            ctypes.CDLL(os.fspath(library), mode=ctypes.RTLD_GLOBAL)
        with ReadOnlyBackend(NvmlBackend(nvml=ReadOnlyNvml(pynvml))) as backend:
            return collect_inventory(backend)

    return nvml


def _record_event(node: str, checks: Sequence[Check]) -> None:
    """The verdict as an Event on the Node (namespace default, as the kubelet records them)."""
    connection = connect(argparse.Namespace())
    verdict = worst(checks)
    failed = [c for c in checks if c.status is Status.FAIL]
    warned = [c for c in checks if c.status is Status.WARN]
    summary = "; ".join(f"{c.name}: {c.detail}" for c in failed + warned) or "every check passed"
    now = datetime.datetime.now(datetime.UTC).isoformat()
    body = {
        "metadata": {"name": f"{node}.preflight-{uuid.uuid4().hex[:10]}", "namespace": "default"},
        "involvedObject": {"kind": "Node", "name": node, "uid": node},
        "reason": "FlexgpuPreflightFailed" if verdict is Status.FAIL else "FlexgpuPreflightPassed",
        "message": f"{verdict.value}: {summary}"[:1024],
        "type": "Warning" if verdict is not Status.OK else "Normal",
        "source": {"component": EVENT_SOURCE, "host": node},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    call(
        connection,
        f"record the preflight Event on node {node}",
        client.CoreV1Api(connection.api).create_namespaced_event,
        "default",
        body,
    )


def _run_node(args: argparse.Namespace) -> int:
    driver_root = Path(args.driver_root) if args.driver_root else None
    host_root = Path(args.host_root) if args.host_root else driver_root
    facts = NodeFacts(
        driver_root=driver_root,
        host_root=host_root,
        kubelet_dir=args.kubelet_dir,
        cdi_dir=args.cdi_dir,
        hook_path=args.hook_path or None,
        image_hook=Path(found) if (found := shutil.which("nvidia-cdi-hook")) else None,
        image_combined_hook=(Path(found) if (found := shutil.which("flexgpu-cdi-hooks")) else None),
    )
    checks = node_checks(facts, _read_inventory(driver_root, args.topology))
    code = _report(checks, args.output)
    if args.record_event:
        try:
            _record_event(args.record_event, checks)
        except CliError as err:
            # The verdict is in the log already; a missing Event must not hide it.
            print(f"flexgpu: {err.message}")
    # In the init container a failed check is reported, not fatal, unless the admin asked.
    return code if args.strict or not args.record_event else ExitCode.OK


def _run_cluster(args: argparse.Namespace) -> int:
    return _report(cluster_checks(connect(args)), args.output)


def add_doctor(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check that the cluster (or, with `node`, this node) can run flexgpu",
        description=(
            "Preflight: the release and DRA gates, nodes served by both NVIDIA's device plugin "
            "and flexgpu, GPU nodes without a plugin, and each node's own verdict. Exit 5 when "
            "a check failed."
        ),
    )
    add_cluster_options(parser, outputs=("json", "yaml"), namespace=False, all_namespaces=False)
    parser.set_defaults(handler=_run_cluster)
    nested = parser.add_subparsers(dest="scope", metavar="SCOPE")
    node = nested.add_parser(
        "node",
        help="check the node this runs on",
        description=(
            "The driver root and driver version, the runtime's CDI settings, whether the CDI "
            "hook runs on this host, NVIDIA's device plugin on this node, GPUs in MIG mode. "
            "Reads only. Exit 5 when a check failed."
        ),
    )
    env = os.environ.get
    node.add_argument(
        "--driver-root",
        default=env("FLEXGPU_DRIVER_ROOT"),
        help="the NVIDIA driver's root as seen here (default: $FLEXGPU_DRIVER_ROOT)",
    )
    node.add_argument(
        "--host-root",
        default=env("FLEXGPU_HOST_ROOT"),
        help="the host's / as seen here (default: the driver root)",
    )
    node.add_argument("--kubelet-dir", default=env("FLEXGPU_KUBELET_DIR", "/var/lib/kubelet"))
    node.add_argument("--cdi-dir", default=env("FLEXGPU_CDI_DIR", "/var/run/cdi"))
    node.add_argument(
        "--hook-path",
        default=env("FLEXGPU_NVIDIA_CDI_HOOK", ""),
        help="the host's nvidia-cdi-hook the specs name (default: the image's copy)",
    )
    node.add_argument("--topology", help="a simulated topology instead of NVML")
    node.add_argument(
        "--record-event",
        metavar="NODE",
        default=None,
        help="record the verdict as an Event on NODE (in a pod: its service account); then "
        "exit 0 even when a check failed, unless --strict",
    )
    node.add_argument("--strict", action="store_true", help="exit 5 on a failed check always")
    node.add_argument("-o", "--output", choices=("json", "yaml"), help="json or yaml")
    node.set_defaults(handler=_run_node)
