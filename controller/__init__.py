"""flexgpu cluster controller (kopf): admission, status, diagnostics, metrics."""
