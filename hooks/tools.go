//go:build tools

// The NVIDIA Container Toolkit programs built beside our own command: nvidia-ctk (CDI spec
// generation by hand, `nvidia-ctk cdi generate`) and nvidia-cdi-hook (the program the hooks in
// the generated edits run).
package tools

import (
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook"
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
)
