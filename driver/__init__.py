"""flexgpu core library: GPU inventory, backends, device model and rendering.

Pure: no API server, no gRPC, no process entry points.
"""
