// flexgpu-cdi-common prints, as JSON, the CDI container edits that every container using an
// NVIDIA GPU needs whatever GPU it gets: the driver's libraries and programs, the IPC sockets,
// the firmware, the hooks that refresh the linker cache and create the driver's symlinks, and
// the control device nodes. They come from the NVIDIA Container Toolkit's own generator
// (nvcdi, NVML mode), run over a driver root; the kubelet plugin runs this once at start and
// merges the result into the CDI specs it writes per claim.
//
// NVML is used only for the driver version; where it cannot be loaded, the generator reads the
// version from the driver libraries' file names.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/NVIDIA/nvidia-container-toolkit/pkg/nvcdi"
	"github.com/sirupsen/logrus"
)

func main() {
	driverRoot := flag.String("driver-root", "/", "folder the NVIDIA driver is installed under")
	devRoot := flag.String("dev-root", "", "folder holding dev/ with the NVIDIA device nodes (default: the driver root)")
	hookPath := flag.String("nvidia-cdi-hook-path", "/usr/bin/nvidia-cdi-hook", "host path of nvidia-cdi-hook, as the container runtime runs it")
	verbose := flag.Bool("v", false, "log the generator's warnings on stderr")
	flag.Parse()
	if flag.NArg() != 0 {
		fmt.Fprintf(os.Stderr, "flexgpu-cdi-common: unexpected argument %q; it takes flags only\n", flag.Arg(0))
		os.Exit(2)
	}
	logger := logrus.New()
	logger.SetOutput(os.Stderr)
	if !*verbose {
		logger.SetOutput(io.Discard)
	}
	root := *devRoot
	if root == "" {
		root = *driverRoot
	}
	lib, err := nvcdi.New(
		nvcdi.WithLogger(logger),
		nvcdi.WithMode(nvcdi.ModeNvml),
		nvcdi.WithDriverRoot(*driverRoot),
		nvcdi.WithDevRoot(root),
		nvcdi.WithNVIDIACDIHookPath(*hookPath),
	)
	if err != nil {
		fmt.Fprintf(os.Stderr, "flexgpu-cdi-common: creating the CDI generator: %v\n", err)
		os.Exit(1)
	}
	edits, err := lib.GetCommonEdits()
	if err != nil {
		fmt.Fprintf(os.Stderr, "flexgpu-cdi-common: driver root %s: %v\n", *driverRoot, err)
		os.Exit(1)
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	if err := out.Encode(edits.ContainerEdits); err != nil {
		fmt.Fprintf(os.Stderr, "flexgpu-cdi-common: writing the edits: %v\n", err)
		os.Exit(1)
	}
}
