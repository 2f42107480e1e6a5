"""The pieces the real-node quickstart comparison rests on, without a node: renaming NVIDIA's
names to flexgpu's (and nothing else), telling a copy that changed more than names, and
reducing two containers' reports to what depends on the driver."""

from __future__ import annotations

from pathlib import Path

from tests.node.nvidia_node import ABSENT, differences, reduce
from tools.node import report
from tools.nvidia_twin.quickstart import name_changes, renamed

MANIFEST = """\
# NVIDIA's comment
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {namespace: gpu-test4, name: mig-devices}
spec:
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
          - cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}
      constraints:
      - {requests: [], matchAttribute: "gpu.nvidia.com/parentUUID"}
      config:
      - opaque:
          driver: gpu.nvidia.com
          parameters: {apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig}
---
apiVersion: v1
kind: Pod
metadata: {namespace: gpu-test4, name: pod}
spec:
  containers: [{name: ctr, image: "ubuntu:22.04"}]
  tolerations: [{key: nvidia.com/gpu, operator: Exists}]
"""


def test_renaming_changes_the_drivers_names_only() -> None:
    got = renamed({"a": ["gpu.nvidia.com", "resource.nvidia.com/v1beta1"], "key": "nvidia.com/gpu"})
    assert got == {"a": ["gpu.flexgpu.dev", "gpu.flexgpu.dev/v1alpha1"], "key": "nvidia.com/gpu"}


def test_a_copy_with_only_names_changed_passes_and_any_other_change_is_named(
    tmp_path: Path,
) -> None:
    nvidia = tmp_path / "nvidia.yaml"
    nvidia.write_text(MANIFEST)
    ours = (
        MANIFEST.replace("# NVIDIA's comment", "# flexgpu's comment")
        .replace("resource.nvidia.com/v1beta1", "gpu.flexgpu.dev/v1alpha1")
        .replace("gpu.nvidia.com", "gpu.flexgpu.dev")
        .replace("mig.nvidia.com", "mig.flexgpu.dev")
    )
    copy = tmp_path / "copy.yaml"
    copy.write_text(ours)
    assert name_changes(nvidia, copy) == []

    copy.write_text(ours.replace("ubuntu:22.04", "ubuntu:24.04"))
    assert name_changes(nvidia, copy) == ["document 1 (Pod pod) differs"]
    copy.write_text(ours.split("---")[0])
    assert name_changes(nvidia, copy) == [f"2 documents in nvidia.yaml, 1 in {copy}"]


def _report(claim: str, minor: int, uid: str) -> report.Report:
    rep = report.Report(seq=1)
    rep.env["HOSTNAME"] = "pod1"
    key = f"FLEXGPU_DEVICE_{uid.upper().replace('-', '_')}_GPU_{minor}"
    rep.env[key] = f"uuid=GPU-{minor:08x}-0000-0000-0000-000000000000;claim={claim};claimUID={uid}"
    path = f"/dev/nvidia{minor}"
    rep.devices[path] = report.Device(path, 195, minor, report.OPEN_ALLOWED)
    return rep


def test_reports_differ_by_nothing_that_depends_on_the_pod() -> None:
    """Two containers given different GPUs through claims of different names and uids reduce
    to the same facts; the claim's namespace stays."""
    a = reduce(_report("gpu-test1/pod1-gpu-x7k2p", 2, "0f0e0d0c-0b0a-4900-8800-112233445566"))
    b = reduce(_report("gpu-test1/pod2-gpu-q9z4r", 5, "1a2b3c4d-5e6f-4a0b-9c1d-2e3f40516273"))
    assert a == b
    assert a["device /dev/nvidia<N>"] == "opens"
    assert a["env FLEXGPU_DEVICE_<UID>_GPU_<N>"] == (
        "uuid=<uuid>;claim=gpu-test1/<claim>;claimUID=<uid>"
    )
    assert differences(a, {}) == {(k, v, ABSENT) for k, v in a.items()}
