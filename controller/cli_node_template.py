"""``flexgpu node-template``: the ResourceSlices the kubelet plugin would publish on a node of
a GPU topology and policy, for autoscalers that provision nodes for pending DRA claims
(cluster-autoscaler's template slices, Karpenter's ResourceSliceTemplates). Needs no cluster;
``--compare-node`` checks a running node of the group against the template instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from flexgpu.controller.cli_options import CliError, ExitCode, call, connect, emit
from flexgpu.driver.autoscaler_shapes import FORMATS, render_shape
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.node_policy import (
    GpuNodePolicy,
    NodePolicyError,
    parse_node_policy,
    select_policy,
)
from flexgpu.driver.node_template import (
    NodeTemplate,
    TemplateError,
    TemplatePolicy,
    render_node_template,
)
from flexgpu.driver.template_check import current_pool, template_differences
from flexgpu.driver.topology import TopologyError, builtin_topology_names, load_topology

# Kubernetes 1.35 moved shared counters into slices of their own (driver.resource_slice).
FIRST_MINOR_WITH_COUNTER_SLICES = 35
FIRST_MINOR_WITH_BINDING_CONDITIONS = 36
GPU_LIST_ALLOWED = '"all" or comma-separated GPU indices such as "0,2"'


def gpu_indices(flag: str, value: str | None, gpu_count: int) -> frozenset[int]:
    """The plugin's ``--shared-gpus`` / ``--dynamic-mig-gpus`` syntax."""
    if not value:
        return frozenset()
    text = value.replace(" ", "")
    if text == "all":
        return frozenset(range(gpu_count))
    if not re.fullmatch(r"\d+(,\d+)*", text):
        raise CliError(f"{flag} {value!r}: allowed: {GPU_LIST_ALLOWED}", ExitCode.USAGE)
    indices = frozenset(int(i) for i in text.split(","))
    outside = sorted(i for i in indices if i >= gpu_count)
    if outside:
        raise CliError(
            f"{flag} {value!r}: GPU {outside[0]} is not on this topology "
            f"({gpu_count} GPUs: 0..{gpu_count - 1})",
            ExitCode.USAGE,
        )
    return indices


def read_policy(path: str) -> GpuNodePolicy:
    try:
        document: Any = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise CliError(f"--policy {path}: cannot read it: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise CliError(f"--policy {path}: not valid YAML: {err}") from None
    if not isinstance(document, dict):
        raise CliError(f"--policy {path}: expected one GpuNodePolicy object (a mapping)")
    try:
        return parse_node_policy(document)
    except NodePolicyError as err:
        raise CliError(f"--policy {path}: {err}") from None


def node_labels(values: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for value in values:
        key, equals, label = value.partition("=")
        if not equals or not key:
            raise CliError(
                f"--node-label {value!r}: allowed: KEY=VALUE, e.g. "
                "node.kubernetes.io/instance-type=p5.48xlarge",
                ExitCode.USAGE,
            )
        labels[key] = label
    return labels


def choose_policy(paths: list[str], labels: list[str]) -> GpuNodePolicy | None:
    """The policy that applies to the group's nodes, chosen as the plugin chooses it (the
    highest priority of those whose nodeSelector selects the labels; a tie applies none)."""
    policies = [read_policy(path) for path in paths]
    if not labels:
        if len(policies) > 1:
            raise CliError(
                f"--policy given {len(policies)} times: name the group's node labels with "
                "--node-label KEY=VALUE so the policy that applies is chosen as on the node",
                ExitCode.USAGE,
            )
        return policies[0] if policies else None
    choice = select_policy(policies, node_labels(labels))
    if choice.is_conflict:
        raise CliError(choice.conflict_message("of this group"))
    if choice.policy is None and policies:
        names = ", ".join(p.name for p in policies)
        print(
            f"flexgpu: no policy ({names}) selects these node labels; the flags alone apply",
            file=sys.stderr,
        )
    return choice.policy


def counters_in_own_slice(version: str | None) -> bool:
    if version is None:
        return True
    match = re.fullmatch(r"v?1\.(\d+)(\.\d+)?", version)
    if match is None:
        raise CliError(
            f"--kubernetes-version {version!r}: allowed: a release such as 1.34 or v1.37.2",
            ExitCode.USAGE,
        )
    return int(match.group(1)) >= FIRST_MINOR_WITH_COUNTER_SLICES


def binding_conditions(setting: str, version: str | None) -> bool:
    """The plugin's --binding-conditions on that release: auto is on from 1.36 (and for an
    unnamed release, taken as a current one)."""
    if setting != "auto":
        return setting == "on"
    if version is None:
        return True
    match = re.fullmatch(r"v?1\.(\d+)(\.\d+)?", version)
    return match is not None and int(match.group(1)) >= FIRST_MINOR_WITH_BINDING_CONDITIONS


def _release(args: argparse.Namespace) -> str | None:
    """--kubernetes-version, or with --compare-node the release of the node's cluster."""
    if args.kubernetes_version is not None or not args.compare_node:
        return str(args.kubernetes_version) if args.kubernetes_version else None
    connection = connect(args)
    info = call(connection, "read the server version", client.VersionApi(connection.api).get_code)
    return f"1.{''.join(c for c in str(info.get('minor', '')) if c.isdigit())}"


def _run(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(Path(args.topology_file) if args.topology_file else args.topology)
    except TopologyError as err:
        raise CliError(str(err)) from None
    count = len(topology.gpus)
    policy = TemplatePolicy(
        shared=gpu_indices("--shared-gpus", args.shared_gpus, count),
        dynamic_mig=gpu_indices("--dynamic-mig-gpus", args.dynamic_mig_gpus, count),
        policy=choose_policy(args.policy or [], args.node_label or []),
        mig_switch_needs_reset=args.mig_mode_needs_reset,
        binding_conditions=binding_conditions(args.binding_conditions, _release(args)),
        shared_gpu_tenants=args.shared_gpu_tenants,
    )
    own_slice = counters_in_own_slice(args.kubernetes_version)
    if args.format == "karpenter" and not own_slice:
        raise CliError(
            "--format karpenter: Karpenter takes counter sets in slices of their own "
            "(Kubernetes 1.35+); --kubernetes-version must be 1.35 or later",
            ExitCode.USAGE,
        )
    try:
        template = render_node_template(topology, policy, counters_in_own_slice=own_slice)
    except TemplateError as err:
        raise CliError(str(err)) from None
    if args.compare_node:
        return compare_node(args, template)
    emit(render_shape(template, args.format), args.output)
    return ExitCode.OK


def compare_node(args: argparse.Namespace, template: NodeTemplate) -> int:
    """Exit 0 when the node publishes the template, 5 (a check failed) with every difference."""
    node = args.compare_node
    connection = connect(args)
    listing = call(
        connection,
        f"list the ResourceSlices of node {node}",
        client.ResourceV1Api(connection.api).list_resource_slice,
        field_selector=f"spec.nodeName={node},spec.driver={DRIVER_NAME}",
    )
    published = current_pool(listing.get("items") or [])
    if not published:
        raise CliError(f"node {node} publishes no {DRIVER_NAME} ResourceSlices")
    found = template_differences(template, published, node)
    if not found:
        devices = sum(len(s.get("devices") or []) for s in published)
        print(f"node {node} publishes the template: {len(published)} slices, {devices} devices")
        return ExitCode.OK
    print(f"node {node} differs from the template in {len(found)} places:")
    for line in found:
        print(f"  {line}")
    return ExitCode.CHECK_FAILED


def add_node_template(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "node-template",
        help="the ResourceSlices a node would publish, for autoscalers (no cluster needed)",
        description=(
            "Print the ResourceSlices the flexgpu kubelet plugin publishes on a healthy, empty "
            "node of this GPU topology and policy, in the shape cluster-autoscaler (template "
            "ResourceSlices) or Karpenter (InstanceType.DynamicResources) takes. Values only "
            "the node knows (node name, pool generation, GPU UUIDs, PCI bus IDs, PCIe roots, "
            "NVLink domain names) are <runtime:...> placeholders; equal placeholders stand "
            "for equal values. Give the plugin's own settings: --shared-gpus, "
            "--dynamic-mig-gpus and the GpuNodePolicy that selects the node's group."
        ),
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--topology",
        metavar="NAME|PATH",
        help=f"the node's GPUs: {', '.join(builtin_topology_names())} or a topology YAML file",
    )
    which.add_argument(
        "--topology-file",
        metavar="PATH",
        help="the node's GPUs from a topology YAML file (the format of driver/topologies)",
    )
    parser.add_argument(
        "--shared-gpus", metavar="all|I,J", help="GPUs published as fractions (the plugin's flag)"
    )
    parser.add_argument(
        "--shared-gpu-tenants",
        choices=("namespace", "any"),
        default="namespace",
        help="the plugin's flag: with namespace (its default) shared GPUs carry a tenant "
        'attribute, "" on a new node',
    )
    parser.add_argument(
        "--dynamic-mig-gpus",
        metavar="all|I,J",
        help="GPUs partitioned on demand with MIG (the plugin's flag)",
    )
    parser.add_argument(
        "--policy",
        metavar="FILE",
        action="append",
        help="a GpuNodePolicy (YAML) that selects the node: its modes and static MIG layouts "
        "override the flags for the GPUs it selects. Repeat it with --node-label to have the "
        "one that applies chosen as on the node (priority, then a tie applies none)",
    )
    parser.add_argument(
        "--node-label",
        metavar="KEY=VALUE",
        action="append",
        help="a label every node of the group carries (repeatable): only a policy whose "
        "nodeSelector selects them applies",
    )
    parser.add_argument(
        "--mig-mode-needs-reset",
        action="store_true",
        help="the GPUs need a reset to change MIG mode: on-demand MIG GPUs then serve "
        "partitions only, no whole-GPU device",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="cluster-autoscaler",
        help="cluster-autoscaler: a List of ResourceSlices; karpenter: resourceSliceTemplates "
        "and attributeBindings of an instance type (default: cluster-autoscaler)",
    )
    parser.add_argument(
        "--kubernetes-version",
        metavar="1.MINOR",
        help="the cluster's release: before 1.35 counter sets travel with their devices "
        "(default: 1.35 or later)",
    )
    parser.add_argument(
        "--binding-conditions",
        choices=("auto", "on", "off"),
        default="auto",
        help="the plugin's setting: on-demand partitions carry binding conditions; auto: "
        "1.36 and later, or when --kubernetes-version is not given (default auto)",
    )
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    check = parser.add_argument_group("check a running node")
    check.add_argument(
        "--compare-node",
        metavar="NODE",
        help="instead of printing the template, compare it with what NODE publishes now: "
        "exit 0 when equal (placeholders aside), 5 with each difference",
    )
    check.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)"
    )
    check.add_argument("--context", help="kubeconfig context to use (default: the current one)")
    parser.set_defaults(handler=_run)
