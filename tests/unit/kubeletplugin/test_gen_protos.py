"""The committed stubs in kubelet_plugin/kubeletplugin/proto/gen (messages, shipped) and
proto/grpc_stubs (gRPC clients for tests and tools, not shipped) are exactly what the
generator writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[3]
GEN = REPO / "kubelet_plugin" / "kubeletplugin" / "proto" / "gen"
GRPC = REPO / "kubelet_plugin" / "kubeletplugin" / "proto" / "grpc_stubs"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "tools" / "gen_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh, fresh_grpc = tmp_path / "gen", tmp_path / "grpc_stubs"
    _load_generator().generate(fresh, grpc_out_dir=fresh_grpc)
    for committed, regenerated in ((_tree(GEN), _tree(fresh)), (_tree(GRPC), _tree(fresh_grpc))):
        assert sorted(committed) == sorted(regenerated), (
            "generated file set differs; run: .venv/bin/python tools/gen_protos.py"
        )
        stale = [name for name in committed if committed[name] != regenerated[name]]
        assert not stale, f"stale files {stale}; run: .venv/bin/python tools/gen_protos.py"


def test_every_proto_has_messages_stubs_and_services() -> None:
    sources = _load_generator().proto_files()
    assert len(sources) == 5
    for source in sources:
        stem = source.with_suffix("")
        for root, suffix in ((GEN, "_pb2.py"), (GEN, "_pb2.pyi"), (GRPC, "_pb2_grpc.py")):
            path = root / stem.with_name(stem.name + suffix)
            assert path.is_file(), f"{source}: no {path}"


def test_imports_are_anchored_in_the_package() -> None:
    grpc_module = (GRPC / "dra" / "v1" / "dra_pb2_grpc.py").read_text()
    expected = "from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2"
    assert expected in grpc_module
    assert "\nfrom dra." not in grpc_module
