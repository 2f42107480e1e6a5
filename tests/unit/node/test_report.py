"""The workload's self-report is read back from a CRI-format container log."""

from __future__ import annotations

from tools.node import report

LOG = """\
T0 stdout F fgr 1 begin
T0 stdout F fgr 1 name one
T0 stdout F fgr 1 env NVIDIA_VISIBLE_DEVICES=void
T0 stdout F fgr 1 env FLEXGPU_DEVICE_C_GPU_0=uuid=GPU-a;device=gpu-0;timeSlice=Short
T0 stdout F fgr 1 env ODD=a=b
T0 stdout F fgr 1 dev /dev/nvidia0 c3:0 No such device or address
T0 stdout F fgr 1 dev /dev/nvidiactl c3:ff Operation not permitted
T0 stdout F fgr 1 file /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
T0 stdout F fgr 1 mount /run/mps/pipe
T0 stdout F fgr 1 meta /var/run/m/gpu.flexgpu.dev-metadata.json {"a": 1}{"a": 2}
T0 stdout F fgr 1 metawrite /var/run/m/gpu.flexgpu.dev-metadata.json Read-only file system
T0 stdout F fgr 1 end
T0 stdout F fgr 2 begin
T0 stdout F fgr 2 env NVIDIA_VISIBLE_DEVICES=GPU-b,GPU-c
"""


def test_complete_reports_only_with_their_fields() -> None:
    reports = report.parse(LOG)
    assert [r.seq for r in reports] == [1]  # report 2 has no end line yet
    rep = reports[0]
    assert rep.name == "one"
    assert rep.env["ODD"] == "a=b"
    assert rep.devices["/dev/nvidia0"].major == 195
    assert rep.devices["/dev/nvidiactl"].minor == 255
    assert rep.devices["/dev/nvidia0"].cgroup_allows
    assert not rep.devices["/dev/nvidiactl"].cgroup_allows
    assert rep.gpu_nodes() == ["/dev/nvidia0"]
    assert rep.files == ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"]
    assert rep.mounts == ["/run/mps/pipe"]
    path = "/var/run/m/gpu.flexgpu.dev-metadata.json"
    assert rep.metadata_objects(path) == [{"a": 1}, {"a": 2}]
    assert rep.metadata_writes == {path: "Read-only file system"}


def test_gpu_uuids_from_either_variable() -> None:
    rep = report.parse(LOG)[0]
    assert rep.visible_devices == ["GPU-a"]  # "void" is no device
    assert rep.time_slices == {"Short"}
    full = report.parse(LOG + "T0 stdout F fgr 2 end\n")[-1]
    assert full.visible_devices == ["GPU-b", "GPU-c"]
    assert full.time_slices == set()


def test_lines_of_other_programs_and_reports_are_ignored() -> None:
    log = "plain text\nfgr x begin\nfgr 3 env A=1\nfgr 4 begin\nfgr 3 env B=2\nfgr 4 end\n"
    (rep,) = report.parse(log)
    assert rep.seq == 4
    assert rep.env == {}
    assert report.latest("") is None
