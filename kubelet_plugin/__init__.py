"""flexgpu kubelet plugin: registration, DRA gRPC, slice publishing, prepare/unprepare."""
