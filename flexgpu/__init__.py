"""flexgpu: a Kubernetes DRA driver for GPU flex nodes.

Installed, the three packages live under this namespace (``flexgpu.driver``,
``flexgpu.kubelet_plugin``, ``flexgpu.controller``); in the repository their folders stay at the
top and this folder links to them, so every tool sees one module name per file.
"""
