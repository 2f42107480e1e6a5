package main

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"k8s.io/klog/v2"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// cdiResolver applies CDI devices to a container's OCI spec with the upstream CDI library,
// the way containerd and CRI-O do for the CDI device names the kubelet passes over CRI.
type cdiResolver struct {
	cache *cdi.Cache
}

func newCDIResolver(dir string) (*cdiResolver, error) {
	// No auto refresh (fsnotify): the cache is refreshed before every injection, so a spec
	// written just before NodePrepareResources returned is always seen.
	c, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if c == nil {
		return nil, err
	}
	if err != nil {
		klog.Background().Info("Some CDI specs could not be loaded", "dir", dir, "err", err)
	}
	return &cdiResolver{cache: c}, nil
}

// inject refreshes the cache and applies the devices' container edits to spec.
func (r *cdiResolver) inject(logger klog.Logger, spec *oci.Spec, devices []string) error {
	if len(devices) == 0 {
		return nil
	}
	if err := r.cache.Refresh(); err != nil {
		logger.V(2).Info("Refreshing the CDI cache reported errors", "err", err)
	}
	unresolved, err := r.cache.InjectDevices(spec, devices...)
	if err == nil {
		return nil
	}
	if len(unresolved) > 0 {
		// Say why a device may be missing: broken spec files are skipped by the cache.
		var specErrs []string
		for path, errs := range r.cache.GetErrors() {
			specErrs = append(specErrs, fmt.Sprintf("%s: %v", path, errors.Join(errs...)))
		}
		sort.Strings(specErrs)
		if len(specErrs) > 0 {
			return fmt.Errorf("%w (CDI spec errors: %s)", err, strings.Join(specErrs, "; "))
		}
	}
	return err
}
