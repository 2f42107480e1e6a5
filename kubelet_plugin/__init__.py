"""flexgpu kubelet plugin, the per-node daemon, in layers (top to bottom; each imports only
from those below it, checked by import-linter): main, probe and their settings; agents/ and
observe/; claims/; devices/; api/; kubeletplugin/. docs/architecture.md says what each holds."""
