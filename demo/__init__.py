"""The flexgpu demo: a local cluster, simulated GPU nodes and a catalog of workloads."""
