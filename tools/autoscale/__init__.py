"""Karpenter in the local test world (tooling, not product): Karpenter with its kwok cloud
provider, GPU instance types carrying flexgpu's node templates (``karpenter``), and the agent
that plays each node Karpenter launches: a simulated flexgpu plugin with the kubelet harness
(``node_agent``). See docs/autoscaling.md."""
