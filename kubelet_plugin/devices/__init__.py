"""The node's devices: the inventory as the plugin publishes and prepares it, what each
device hands its container (device nodes, the driver's common CDI edits), and the
ResourceSlices that publish them."""
