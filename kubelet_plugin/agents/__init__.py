"""What acts on its own, each on a thread of its own: the node policy agent, the binding
watch (binding conditions), the GPU health monitor and the MPS daemon pods."""
