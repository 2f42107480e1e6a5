"""``flexgpu`` (also ``kubectl flexgpu``): the user-facing command line.

Each subcommand module brings an ``add_<name>(subparsers)`` that registers its parser and
handler; ``SUBCOMMANDS`` lists them, so a new one is one line here. Errors end the command
with one line on stderr and an exit status from ``controller.cli_options.ExitCode``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from flexgpu.controller.cli_capacity import add_capacity
from flexgpu.controller.cli_doctor import add_doctor
from flexgpu.controller.cli_explain_command import add_explain
from flexgpu.controller.cli_health import add_health
from flexgpu.controller.cli_node_template import add_node_template
from flexgpu.controller.cli_options import CliError, ExitCode
from flexgpu.controller.cli_usage import add_usage
from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import BackendUnavailableError, GpuBackendError
from flexgpu.driver.inventory import collect_inventory
from flexgpu.driver.inventory_report import gpu_table, mig_table
from flexgpu.driver.nvml_readonly import ReadOnlyNvml
from flexgpu.driver.readonly_backend import ReadOnlyBackend
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.sim_state import SimulatedStateError
from flexgpu.driver.topology import TopologyError, builtin_topology_names
from flexgpu.driver.version import VERSION

Handler = Callable[[argparse.Namespace], int]


def _fail(message: str, code: int = ExitCode.FAILED) -> int:
    print(f"flexgpu: {message}", file=sys.stderr)
    return code


def _inventory_backend(args: argparse.Namespace) -> GpuBackend:
    if args.topology:
        return SimulatedBackend.from_topology(args.topology, args.node_name, args.state_file)
    try:
        import pynvml

        from flexgpu.driver.nvml_backend import NvmlBackend
    except ImportError as exc:
        raise BackendUnavailableError(f"the pynvml module is missing ({exc})") from None
    return NvmlBackend(nvml=ReadOnlyNvml(pynvml))


def _run_inventory(args: argparse.Namespace) -> int:
    try:
        backend = _inventory_backend(args)
    except BackendUnavailableError as exc:
        return _fail(
            f"NVML is not available on this machine ({exc.message}); "
            "use --topology NAME to list a simulated node"
        )
    except (TopologyError, SimulatedStateError) as exc:
        return _fail(str(exc))
    # Listing must never change a GPU setting, whatever the backend.
    with ReadOnlyBackend(backend) as readonly:
        try:
            inventory = collect_inventory(readonly)
        except GpuBackendError as exc:
            return _fail(f"cannot read the GPU inventory: {exc.message}")
    if args.json:
        print(json.dumps(inventory.model_dump(mode="json"), indent=2))
        return 0
    print(gpu_table(inventory))
    if args.mig:
        print()
        print(mig_table(inventory))
    return 0


def _add_inventory(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "inventory",
        help="list the node's GPUs (real ones through NVML, or a simulated topology)",
        description="List GPUs and, with --mig, every MIG placement. Never changes a GPU setting.",
    )
    parser.add_argument(
        "--topology",
        metavar="NAME|PATH",
        help=f"simulate this topology instead of using NVML ({', '.join(builtin_topology_names())}"
        " or a YAML file)",
    )
    parser.add_argument(
        "--node-name", default="flexgpu-sim", help="simulated node name (UUIDs derive from it)"
    )
    parser.add_argument(
        "--state-file", help="simulated node state to read (MIG instances of a running plugin)"
    )
    parser.add_argument("--mig", action="store_true", help="also list MIG profiles and placements")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=_run_inventory)


Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
# In the order `flexgpu --help` lists them.
SUBCOMMANDS: tuple[Registrar, ...] = (
    _add_inventory,
    add_explain,
    add_capacity,
    add_usage,
    add_doctor,
    add_node_template,
    add_health,
)


def _version() -> str:
    # The source's own version, not the installed metadata's: an editable install keeps the
    # version it was installed with, the source is what runs.
    return VERSION


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexgpu", description="flexgpu GPU driver tools")
    parser.add_argument("--version", action="version", version=f"flexgpu {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return int(handler(args))
    except CliError as err:
        return _fail(err.message, err.code)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `flexgpu capacity | head`: the reader left; nothing to say.
        sys.stderr.close()
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
