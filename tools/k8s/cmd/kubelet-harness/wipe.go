package main

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/fields"
)

// wipeObserver notices (from the HTTP traffic of our client) when the upstream DRA plugin
// manager's startup wipe, a DeleteCollection of resourceslices with the field selector
// spec.nodeName=<node> and no driver, has succeeded. The wipe itself is upstream code;
// this only lets READY wait for it.
type wipeObserver struct {
	selector string
	once     sync.Once
	done     chan struct{}
}

func newWipeObserver(nodeName string) *wipeObserver {
	return &wipeObserver{
		selector: fields.Set{resourceapi.ResourceSliceSelectorNodeName: nodeName}.String(),
		done:     make(chan struct{}),
	}
}

func (w *wipeObserver) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
		resp, err := rt.RoundTrip(req)
		if err == nil && req.Method == http.MethodDelete && resp.StatusCode < 300 &&
			strings.HasSuffix(req.URL.Path, "/resourceslices") &&
			req.URL.Query().Get("fieldSelector") == w.selector {
			w.once.Do(func() { close(w.done) })
		}
		return resp, err
	})
}

// wait blocks until the wipe happened (true) or ctx ends (false), calling waiting every 10s.
func (w *wipeObserver) wait(ctx context.Context, waiting func()) bool {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-w.done:
			return true
		case <-ctx.Done():
			return false
		case <-t.C:
			waiting()
		}
	}
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }
