// Command nvml-mock is built with -buildmode=c-shared into libnvidia-ml.so.1: NVML's C entry
// points, as nvml.h declares them, over NVIDIA's mock NVML servers (go-nvml pkg/nvml/mock).
// See docs/inventory.md for what comes from the mock tables and what this library adds.
package main

import "C"

func main() {}
