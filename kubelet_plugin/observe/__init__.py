"""Observation of the plugin: metrics, GPU usage per device and per claim, the health
endpoint for the kubelet's probes, a backend that counts what is done to the hardware."""
