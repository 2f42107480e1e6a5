"""The kubelet gRPC APIs: our .proto sources and, in gen/, the stubs generated from them."""
