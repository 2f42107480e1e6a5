"""Our .proto definitions must match the kubelet's on everything that reaches the wire.

The upstream files come from the k8s.io/kubelet Go module at the version pinned in
tools/k8s/go.mod (downloaded by tools/k8s/build.sh). They are compiled with grpc_tools.protoc
and compared with the descriptors of our generated stubs: packages, services, methods and
their streaming flags and types, messages (nested ones and map entries included), fields
(name, number, type, label, proto3 optional, oneof) and enums.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2 as d

from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2 as dra_v1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1beta1 import dra_pb2 as dra_v1beta1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra_health.v1 import health_pb2 as health_v1
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra_health.v1alpha1 import (
    health_pb2 as health_v1alpha1,
)
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import registration_pb2
from tests.go_modules import module_dir

SKIP_ENV = "FLEXGPU_SKIP_UPSTREAM_PROTO"

# Upstream file (relative to k8s.io/kubelet/pkg/apis) -> our generated module.
PAIRS: dict[str, ModuleType] = {
    "pluginregistration/v1/api.proto": registration_pb2,
    "dra/v1/api.proto": dra_v1,
    "dra/v1beta1/api.proto": dra_v1beta1,
    "dra-health/v1alpha1/api.proto": health_v1alpha1,
    "dra-health/v1/api.proto": health_v1,
}


_GOGO_IMPORT = re.compile(
    r'^\s*import\s+"github\.com/gogo/protobuf/gogoproto/gogo\.proto"\s*;\s*$', re.M
)
_GOGO_STATEMENT = re.compile(r"^\s*option\s+\(gogoproto\.\w+\)\s*=\s*[^;]+;\s*$", re.M)
_GOGO_FIELD_OPTION = re.compile(r'\(gogoproto\.\w+\)\s*=\s*("[^"]*"|[\w.]+)\s*,?\s*')


def strip_gogo(text: str) -> str:
    """Drop gogoproto's import and options: they shape Go code only, never the wire."""
    text = _GOGO_IMPORT.sub("", text)
    text = _GOGO_STATEMENT.sub("", text)
    text = _GOGO_FIELD_OPTION.sub("", text)
    text = re.sub(r",\s*\]", "]", text)
    return re.sub(r"\s*\[\s*\]", "", text)


def compile_descriptor_set(root: Path, files: list[str], workdir: Path) -> d.FileDescriptorSet:
    include = workdir / "include"
    for name in files:
        target = include / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(strip_gogo((root / name).read_text()))
    out = workdir / "set.pb"
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{include}",
        f"-I{well_known}",
        f"--descriptor_set_out={out}",
        *files,
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert result.returncode == 0, f"protoc failed on upstream files:\n{result.stderr}"
    return d.FileDescriptorSet.FromString(out.read_bytes())


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> dict[str, d.FileDescriptorProto]:
    apis = module_dir("k8s.io/kubelet") / "pkg" / "apis"
    missing = [name for name in PAIRS if not (apis / name).is_file()]
    if missing:
        message = (
            f"upstream kubelet .proto files not found under {apis} ({', '.join(missing)}); "
            "run tools/k8s/build.sh to download the Go modules"
        )
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"{message} ({SKIP_ENV}=1)")
        pytest.fail(message)
    fds = compile_descriptor_set(apis, list(PAIRS), tmp_path_factory.mktemp("upstream"))
    return {f.name: f for f in fds.file}


def ours(module: ModuleType) -> d.FileDescriptorProto:
    return d.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)


def _enum_shape(enum: d.EnumDescriptorProto) -> dict[str, int]:
    return {v.name: v.number for v in enum.value}


def _message_shape(message: d.DescriptorProto) -> dict[str, Any]:
    fields = {}
    for f in message.field:
        oneof = message.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
        fields[f.name] = {
            "number": f.number,
            "type": d.FieldDescriptorProto.Type.Name(f.type),
            "type_name": f.type_name,
            "label": d.FieldDescriptorProto.Label.Name(f.label),
            "proto3_optional": f.proto3_optional,
            "oneof": oneof,
            "packed": f.options.packed if f.options.HasField("packed") else None,
        }
    return {
        "fields": fields,
        "map_entry": message.options.map_entry,
        "nested": {n.name: _message_shape(n) for n in message.nested_type},
        "enums": {e.name: _enum_shape(e) for e in message.enum_type},
    }


def shape(file: d.FileDescriptorProto) -> dict[str, Any]:
    """Everything about a file that decides wire compatibility, as plain data."""
    return {
        "package": file.package,
        "syntax": file.syntax or "proto2",
        "services": {
            s.name: {
                m.name: {
                    "input": m.input_type,
                    "output": m.output_type,
                    "client_streaming": m.client_streaming,
                    "server_streaming": m.server_streaming,
                }
                for m in s.method
            }
            for s in file.service
        },
        "messages": {m.name: _message_shape(m) for m in file.message_type},
        "enums": {e.name: _enum_shape(e) for e in file.enum_type},
    }


@pytest.mark.parametrize("upstream_name", list(PAIRS))
def test_matches_upstream(upstream: dict[str, d.FileDescriptorProto], upstream_name: str) -> None:
    theirs, mine = shape(upstream[upstream_name]), shape(ours(PAIRS[upstream_name]))
    assert mine == theirs, f"{PAIRS[upstream_name].__name__} differs from upstream {upstream_name}"


def test_upstream_services_are_the_ones_we_serve(
    upstream: dict[str, d.FileDescriptorProto],
) -> None:
    paths = sorted(
        f"/{f.package}.{s.name}/{m.name}"
        for f in upstream.values()
        for s in f.service
        for m in s.method
    )
    assert paths == [
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
        "/v1.DRAResourceHealth/NodeWatchResources",
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
    ]


def test_shape_notices_a_changed_field_number() -> None:
    changed = ours(dra_v1)
    device = next(m for m in changed.message_type if m.name == "Device")
    device.field[0].number = 9
    assert shape(changed) != shape(ours(dra_v1))


def test_strip_gogo_leaves_a_file_protoc_accepts(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "x").mkdir(parents=True)
    (source / "x" / "api.proto").write_text(
        'syntax = "proto3";\npackage x;\n'
        'import "github.com/gogo/protobuf/gogoproto/gogo.proto";\n'
        "option (gogoproto.goproto_getters_all) = false;\n"
        "message M {\n"
        '  string a = 1 [(gogoproto.customname) = "A", (gogoproto.nullable) = false];\n'
        '  repeated int64 b = 2 [packed = true, (gogoproto.casttype) = "T"];\n'
        "}\n"
    )
    fds = compile_descriptor_set(source, ["x/api.proto"], tmp_path / "work")
    message = shape(fds.file[0])["messages"]["M"]
    assert list(message["fields"]) == ["a", "b"]
    assert message["fields"]["b"]["packed"] is True
    assert not fds.file[0].dependency
