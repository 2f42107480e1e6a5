// flexgpu-registry is the distribution (CNCF) registry with its filesystem storage driver
// only: the real-node tests push the flexgpu image to it and the node's containerd pulls the
// image from it. Leaving out the cloud storage drivers keeps the build small.
package main

import (
	"os"

	"github.com/distribution/distribution/v3/registry"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/inmemory"
)

func main() {
	if err := registry.RootCmd.Execute(); err != nil {
		os.Exit(1)
	}
}
