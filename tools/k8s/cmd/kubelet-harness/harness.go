package main

import (
	"context"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/cm/resourceupdates"
)

// harness keeps one pod worker per pod bound to the node, like the kubelet's pod workers.
type harness struct {
	ctx        context.Context
	opts       *options
	podsDir    string
	client     kubernetes.Interface
	recorder   record.EventRecorder
	dra        *dra.Manager
	nodeLister corelisters.NodeLister
	cdi        *cdiResolver

	mu      sync.Mutex
	started bool
	workers map[types.UID]*podWorker
	wg      sync.WaitGroup
}

func newHarness(ctx context.Context, opts *options, podsDir string, client kubernetes.Interface,
	recorder record.EventRecorder, draManager *dra.Manager, nodeLister corelisters.NodeLister) *harness {
	resolver, err := newCDIResolver(opts.cdiDir)
	if err != nil {
		klog.FromContext(ctx).Error(err, "Creating the CDI cache", "dir", opts.cdiDir)
	}
	return &harness{
		ctx:        ctx,
		opts:       opts,
		podsDir:    podsDir,
		client:     client,
		recorder:   recorder,
		dra:        draManager,
		nodeLister: nodeLister,
		cdi:        resolver,
		workers:    map[types.UID]*podWorker{},
	}
}

func (h *harness) podChanged(obj any) {
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	w := h.workers[pod.UID]
	if w == nil {
		w = newPodWorker(h, pod)
		h.workers[pod.UID] = w
		if h.started {
			h.launch(w)
		}
	}
	w.update(pod)
}

func (h *harness) podRemoved(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	w := h.workers[pod.UID]
	if w == nil {
		return
	}
	if !h.started {
		// Never ran here; the DRA manager's reconcile loop unprepares whatever its
		// checkpoint still holds for the pod.
		delete(h.workers, pod.UID)
		return
	}
	w.markRemoved()
}

// start launches the workers; pods seen before only get queued (the DRA manager must be
// started before PrepareResources can be called).
func (h *harness) start() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.started = true
	for _, w := range h.workers {
		h.launch(w)
	}
}

func (h *harness) launch(w *podWorker) {
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		w.run(h.ctx)
		h.mu.Lock()
		if h.workers[w.uid] == w {
			delete(h.workers, w.uid)
		}
		h.mu.Unlock()
	}()
}

// wait blocks until all workers have returned (after the context is canceled they stop
// their processes and return).
func (h *harness) wait() { h.wg.Wait() }

// activePods is the DRA manager's ActivePodsFunc: like the kubelet's GetActivePods, pods
// that are neither terminal nor terminating with their containers stopped. The DRA
// manager's reconcile loop unprepares claims of pods not in this list.
func (h *harness) activePods() []*v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	pods := make([]*v1.Pod, 0, len(h.workers))
	for _, w := range h.workers {
		if w.active.Load() {
			pods = append(pods, w.latest())
		}
	}
	return pods
}

// forwardHealthUpdates consumes the DRA manager's resource health updates (the kubelet
// feeds them into its pod config sources) and refreshes the affected pods' status, where
// allocatedResourcesStatus comes from the DRA manager.
func (h *harness) forwardHealthUpdates(updates <-chan resourceupdates.Update) {
	for {
		select {
		case <-h.ctx.Done():
			return
		case u := <-updates:
			h.mu.Lock()
			for _, uid := range u.PodUIDs {
				if w := h.workers[types.UID(uid)]; w != nil {
					w.poke(w.healthWake)
				}
			}
			h.mu.Unlock()
		}
	}
}
