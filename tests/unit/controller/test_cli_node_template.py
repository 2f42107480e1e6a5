"""``flexgpu node-template``: the plugin's flags and a GpuNodePolicy file in, a template in
either autoscaler's shape out as YAML or JSON; bad input ends with one line naming the flag,
the value and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexgpu.controller import cli
from flexgpu.controller.cli_options import ExitCode

POLICY = """
apiVersion: flexgpu.dev/v1alpha1
kind: GpuNodePolicy
metadata: {name: split}
spec:
  gpus:
    - selector: {indices: [0]}
      mode: MIG
      migLayout: {"3g.40gb": 2}
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["node-template", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def devices(document: dict[str, Any]) -> list[str]:
    return [d["name"] for item in document["items"] for d in item["spec"].get("devices") or []]


def test_default_is_cluster_autoscaler_slices_as_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--topology", "l4-2-pcie")
    assert code == ExitCode.OK
    document = yaml.safe_load(out)
    assert document["kind"] == "List"
    assert devices(document) == ["gpu-0", "gpu-1"]


def test_flags_as_the_plugin_takes_them(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "--topology", "hgx-h100-8", "--shared-gpus", "0,1", "--dynamic-mig-gpus", "7"
    )
    assert code == ExitCode.OK
    document = yaml.safe_load(out)
    items = {d["name"]: d for item in document["items"] for d in item["spec"].get("devices") or []}
    assert items["gpu-0"]["allowMultipleAllocations"] is True
    assert "gpu-7-mig-1g10gb-0" in items
    assert document["items"][0]["spec"]["sharedCounters"][0]["name"] == "gpu-7"


def test_policy_file_and_topology_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    topology = Path(__file__).parents[3] / "driver" / "topologies" / "hgx-h100-8.yaml"
    code, out, _ = run(
        capsys, "--topology-file", str(topology), "--policy", str(policy), "-o", "json"
    )
    assert code == ExitCode.OK
    names = devices(json.loads(out))
    assert names[:2] == ["gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"] and "gpu-0" not in names


def test_karpenter_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--topology", "hgx-h100-8", "--format", "karpenter")
    assert code == ExitCode.OK
    document = yaml.safe_load(out)
    assert set(document) == {"resourceSliceTemplates", "attributeBindings"}
    (only,) = document["resourceSliceTemplates"]
    assert "uuid" not in only["devices"][0]["attributes"]
    (nvlink,) = document["attributeBindings"]
    # The six GPUs published whole (GPUs 6 and 7 are in MIG mode with no MIG devices).
    assert nvlink["attribute"] == "gpu.flexgpu.dev/nvlinkDomain" and len(nvlink["devices"]) == 6


def test_before_1_35_counters_travel_with_devices(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "--topology", "h200-4", "--dynamic-mig-gpus", "all", "--kubernetes-version", "1.34"
    )
    assert code == ExitCode.OK
    for item in yaml.safe_load(out)["items"]:
        assert item["spec"]["devices"], "each counter set in the slice of its devices"


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (
            ["--topology", "l4-2-pcie", "--shared-gpus", "0;1"],
            ExitCode.USAGE,
            "--shared-gpus '0;1': allowed: \"all\" or comma-separated GPU indices",
        ),
        (
            ["--topology", "l4-2-pcie", "--dynamic-mig-gpus", "3"],
            ExitCode.USAGE,
            "--dynamic-mig-gpus '3': GPU 3 is not on this topology (2 GPUs: 0..1)",
        ),
        (
            ["--topology", "l4-2-pcie", "--dynamic-mig-gpus", "0", "--shared-gpus", "0"],
            ExitCode.FAILED,
            "GPU 0 is both shared and dynamic MIG",
        ),
        (["--topology", "dgx-z9"], ExitCode.FAILED, "unknown topology 'dgx-z9'; built-in"),
        (
            ["--topology", "l4-2-pcie", "--kubernetes-version", "2.0"],
            ExitCode.USAGE,
            "--kubernetes-version '2.0': allowed: a release such as 1.34",
        ),
        (
            ["--topology", "l4-2-pcie", "--format", "karpenter", "--kubernetes-version", "1.34"],
            ExitCode.USAGE,
            "--kubernetes-version must be 1.35 or later",
        ),
        (
            ["--topology", "l4-2-pcie", "--policy", "/nonexistent/policy.yaml"],
            ExitCode.FAILED,
            "--policy /nonexistent/policy.yaml: cannot read it",
        ),
    ],
)
def test_bad_input_names_the_flag_and_what_is_allowed(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    got, out, err = run(capsys, *argv)
    assert got == code
    assert out == ""
    assert message in err and err.count("\n") == 1


def test_an_invalid_policy_names_its_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.replace("mode: MIG", "mode: Sliced"))
    code, out, err = run(capsys, "--topology", "l4-2-pcie", "--policy", str(policy))
    assert code == ExitCode.FAILED and out == ""
    assert f"--policy {policy}:" in err and "spec.gpus[0].mode" in err


def test_a_layout_the_gpu_cannot_hold_fails_naming_the_gpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.replace('"3g.40gb": 2', '"3g.40gb": 3'))
    code, out, err = run(capsys, "--topology", "hgx-h100-8", "--policy", str(policy))
    assert code == ExitCode.FAILED and out == ""
    assert "GPU 0: migLayout:" in err


def test_compare_node_with_an_unreachable_server_fails_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        'clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]\n'
        "users: [{name: u, user: {token: x}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n"
    )
    code, out, err = run(
        capsys,
        "--topology",
        "l4-2-pcie",
        "--compare-node",
        "gpu-a",
        "--kubeconfig",
        str(kubeconfig),
    )
    assert code == ExitCode.FAILED and out == ""
    assert "cannot reach the API server at https://127.0.0.1:1" in err and err.count("\n") == 1


def policy_file(tmp_path: Path, name: str, priority: int, layout: str, pool: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        POLICY.replace("name: split", f"name: {name}")
        .replace('"3g.40gb": 2', layout)
        .replace(
            "spec:\n",
            f"spec:\n  priority: {priority}\n  nodeSelector: {{matchLabels: {{pool: {pool}}}}}\n",
        )
    )
    return str(path)


def test_of_several_policies_the_one_the_node_would_apply_is_used(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    low = policy_file(tmp_path, "low", 1, '"3g.40gb": 2', "gpu")
    high = policy_file(tmp_path, "high", 5, '"1g.10gb": 7', "gpu")
    other = policy_file(tmp_path, "other", 9, '"7g.80gb": 1', "cpu")
    argv = ["--topology", "hgx-h100-8", "--policy", low, "--policy", high, "--policy", other]
    code, out, _ = run(capsys, *argv, "--node-label", "pool=gpu")
    assert code == ExitCode.OK
    names = devices(yaml.safe_load(out))
    assert "gpu-0-mig-1g10gb-0" in names and "gpu-0-mig-3g40gb-0" not in names

    code, out, err = run(capsys, *argv)
    assert code == ExitCode.USAGE and out == ""
    assert "--policy given 3 times: name the group's node labels with --node-label" in err

    code, out, err = run(capsys, *argv, "--node-label", "pool=tpu")
    assert code == ExitCode.OK
    assert "no policy (low, high, other) selects these node labels" in err
    assert devices(yaml.safe_load(out))[0] == "gpu-0"


def test_policies_tied_at_the_top_apply_none_and_the_command_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    one = policy_file(tmp_path, "one", 3, '"3g.40gb": 2', "gpu")
    two = policy_file(tmp_path, "two", 3, '"1g.10gb": 7', "gpu")
    code, out, err = run(
        capsys,
        "--topology",
        "hgx-h100-8",
        "--policy",
        one,
        "--policy",
        two,
        "--node-label",
        "pool=gpu",
    )
    assert code == ExitCode.FAILED and out == ""
    assert "policies one, two all select node of this group with priority 3" in err


def test_a_node_label_without_a_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--topology", "l4-2-pcie", "--node-label", "pool")
    assert code == ExitCode.USAGE
    assert "--node-label 'pool': allowed: KEY=VALUE" in err
