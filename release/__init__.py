"""The release: the flexgpu image recipe (the image the release publishes and every test runs),
its OCI layout and cache, and the push to a registry (docs/releasing.md)."""
