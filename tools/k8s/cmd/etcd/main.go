// Command etcd is the upstream etcd server entry point, built at the version
// Kubernetes itself depends on.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
