package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	"k8s.io/kubernetes/third_party/forked/golang/expansion"
	"k8s.io/utils/ptr"
)

const (
	// defaultPath stands in for the PATH an image's config would provide (containerd's default).
	defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	// minimumGracePeriod is kuberuntime's minimum grace period when killing containers.
	minimumGracePeriod = 2 * time.Second
)

type containerState int

const (
	stateWaiting containerState = iota
	stateRunning
	stateTerminated
)

// ctr is the runtime state of one container of the pod.
type ctr struct {
	spec *v1.Container
	init bool

	// resolved before the pod starts
	argv     []string
	env      []string
	dir      string
	startErr string // a permanent start error (reported as StartError, exit code 128)

	state      containerState
	reason     string
	message    string
	id         string
	exitCode   int32
	startedAt  time.Time
	finishedAt time.Time
	proc       *proc
}

// podWorker drives one pod through prepare → run → terminate, like the kubelet's pod
// worker (SyncPod, SyncTerminatingPod, SyncTerminatedPod).
type podWorker struct {
	h      *harness
	uid    types.UID
	dir    string
	logger klog.Logger

	mu      sync.Mutex
	pod     *v1.Pod // latest version seen by the informer
	removed bool    // the pod object is gone from the API server

	wake       chan struct{} // pod updated or removed
	healthWake chan struct{} // DRA health update for this pod
	exitCh     chan *ctr     // a container process exited
	active     atomic.Bool

	// Owned by the run goroutine.
	ctrs       []*ctr // init containers first, then containers
	startTime  metav1.Time
	prepared   bool // PrepareResources succeeded, containers resolved
	sandbox    bool // "pod sandbox" ready: prepared and not yet torn down
	mainStart  bool // main containers have been started
	initFailed bool
	terminal   v1.PodPhase
	message    string
	reason     string
	finalized  bool
	conds      map[v1.PodConditionType]v1.PodCondition
}

func newPodWorker(h *harness, pod *v1.Pod) *podWorker {
	w := &podWorker{
		h:          h,
		uid:        pod.UID,
		dir:        filepath.Join(h.podsDir, pod.Namespace+"_"+pod.Name),
		logger:     klog.LoggerWithValues(klog.FromContext(h.ctx), "pod", klog.KObj(pod), "podUID", pod.UID),
		pod:        pod,
		wake:       make(chan struct{}, 1),
		healthWake: make(chan struct{}, 1),
		conds:      map[v1.PodConditionType]v1.PodCondition{},
	}
	w.active.Store(!isTerminalPhase(pod.Status.Phase))
	return w
}

func isTerminalPhase(p v1.PodPhase) bool { return p == v1.PodSucceeded || p == v1.PodFailed }

func (w *podWorker) poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

func (w *podWorker) update(pod *v1.Pod) {
	w.mu.Lock()
	w.pod = pod
	w.mu.Unlock()
	w.poke(w.wake)
}

func (w *podWorker) markRemoved() {
	w.mu.Lock()
	w.removed = true
	w.mu.Unlock()
	w.poke(w.wake)
}

func (w *podWorker) latest() *v1.Pod {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pod
}

func (w *podWorker) isRemoved() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.removed
}

// terminationRequested: deletionTimestamp set, or the pod object is gone.
func (w *podWorker) terminationRequested() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.removed || w.pod.DeletionTimestamp != nil
}

func (w *podWorker) run(ctx context.Context) {
	ctx = klog.NewContext(ctx, w.logger)
	pod := w.latest()
	if isTerminalPhase(pod.Status.Phase) {
		// Finished before we saw it (e.g. before a harness restart): like a kubelet
		// restart, make sure nothing stays prepared, then only finalize deletion.
		w.logger.V(2).Info("Pod is already terminal", "phase", pod.Status.Phase)
		w.terminal = pod.Status.Phase
		w.unprepare(ctx)
		w.idle(ctx)
		return
	}
	w.logger.Info("Syncing pod")
	if err := os.MkdirAll(w.dir, 0o750); err != nil {
		w.logger.Error(err, "Creating pod folder", "path", w.dir)
	}
	w.startTime = rfc(time.Now())
	if pod.Status.StartTime != nil {
		w.startTime = *pod.Status.StartTime
	}
	for i := range pod.Spec.InitContainers {
		w.ctrs = append(w.ctrs, &ctr{spec: &pod.Spec.InitContainers[i], init: true, reason: "PodInitializing"})
	}
	for i := range pod.Spec.Containers {
		reason := "ContainerCreating"
		if len(pod.Spec.InitContainers) > 0 {
			reason = "PodInitializing"
		}
		w.ctrs = append(w.ctrs, &ctr{spec: &pod.Spec.Containers[i], reason: reason})
	}
	if len(pod.Spec.InitContainers) > 0 {
		w.ctrs[0].reason = "ContainerCreating"
	}
	w.exitCh = make(chan *ctr, len(w.ctrs))

	if w.adoptLost(pod) {
		// It ran under an earlier harness process, whose processes are gone with it.
		w.logger.Info("Containers of the pod were started by an earlier harness process and are gone; terminating the pod")
	} else if w.syncUntilStarted(ctx) {
		w.runUntilDone(ctx)
	}
	if ctx.Err() != nil {
		// Harness shutdown: stop our processes, leave claims prepared and the status as is
		// (a kubelet restart does not touch running pods either).
		w.stopAll(w.h.opts.shutdownGrace, false)
		return
	}
	w.terminate(ctx)
	if ctx.Err() != nil {
		return
	}
	w.idle(ctx)
}

// adoptLost handles a non-terminal pod whose status shows containers that were started
// (by an earlier harness process). Like the kubelet when a container of a restartPolicy
// Never pod can no longer be found, it reports them terminated with exit code 137 and
// reason ContainerStatusUnknown (keeping already terminated states), and returns true:
// the pod then terminates (unprepare, terminal phase) without running anything.
func (w *podWorker) adoptLost(pod *v1.Pod) bool {
	prev := map[string]v1.ContainerStatus{}
	for _, cs := range pod.Status.InitContainerStatuses {
		prev["init/"+cs.Name] = cs
	}
	for _, cs := range pod.Status.ContainerStatuses {
		prev["main/"+cs.Name] = cs
	}
	lost := false
	for _, c := range w.ctrs {
		key := "main/" + c.spec.Name
		if c.init {
			key = "init/" + c.spec.Name
		}
		cs, ok := prev[key]
		if !ok || (cs.State.Running == nil && cs.State.Terminated == nil) {
			continue
		}
		lost = true
		if !c.init {
			w.mainStart = true
		}
		c.state, c.id = stateTerminated, cs.ContainerID
		if t := cs.State.Terminated; t != nil {
			c.exitCode, c.reason, c.message = t.ExitCode, t.Reason, t.Message
			c.startedAt, c.finishedAt = t.StartedAt.Time, t.FinishedAt.Time
		} else {
			c.exitCode, c.reason = 137, "ContainerStatusUnknown"
			c.message = "The container could not be located when the pod was terminated"
			c.startedAt, c.finishedAt = cs.State.Running.StartedAt.Time, time.Now()
		}
		if c.init && c.exitCode != 0 {
			w.initFailed = true
		}
	}
	if lost && !w.mainStart {
		w.initFailed = true
	}
	return lost
}

// syncUntilStarted prepares the pod's resources and starts its containers, retrying with
// backoff on failure. It returns false when the pod must terminate before its main
// containers were started (deletion, failed init container, shutdown).
func (w *podWorker) syncUntilStarted(ctx context.Context) bool {
	w.syncStatus(ctx)
	backoff := time.Second
	for {
		if w.terminationRequested() || ctx.Err() != nil {
			return false
		}
		err := w.prepareAndCreate(ctx)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return false
		}
		w.syncStatus(ctx)
		w.logger.V(2).Info("Retrying pod sync after backoff", "backoff", backoff)
		if !w.sleep(ctx, backoff) {
			return false
		}
		backoff = min(2*backoff, w.h.opts.maxBackoff)
	}
	w.message, w.reason = "", ""
	w.sandbox = true

	// Init containers run one after the other; each must succeed (restartPolicy Never).
	for _, c := range w.ctrs {
		if !c.init {
			continue
		}
		w.startContainer(ctx, c)
		w.syncStatus(ctx)
		for c.state != stateTerminated {
			select {
			case ec := <-w.exitCh:
				w.containerExited(ec)
			case <-w.wake:
				if w.terminationRequested() {
					return false
				}
			case <-ctx.Done():
				return false
			}
		}
		if c.exitCode != 0 {
			w.initFailed = true
			return false
		}
	}
	for _, c := range w.ctrs {
		if !c.init {
			c.reason = "ContainerCreating"
		}
	}
	for _, c := range w.ctrs {
		if !c.init {
			w.startContainer(ctx, c)
		}
	}
	w.mainStart = true
	return true
}

// prepareAndCreate calls the DRA manager's PrepareResources (as kuberuntime's SyncPod does
// before creating the sandbox), then resolves every container's CDI devices (as the runtime
// does when creating the container).
func (w *podWorker) prepareAndCreate(ctx context.Context) error {
	pod := w.latest()
	if err := w.h.dra.PrepareResources(ctx, pod); err != nil {
		w.message = fmt.Sprintf("Failed to prepare dynamic resources: %v", err)
		w.reason = ""
		w.h.recorder.Eventf(pod, v1.EventTypeWarning, "FailedPrepareDynamicResources", "Failed to prepare dynamic resources: %v", err)
		w.logger.Error(err, "Failed to prepare dynamic resources")
		return err
	}
	w.message, w.reason = "", ""
	w.sandbox = true // the DRA manager now tracks the pod
	w.prepared = true
	for _, c := range w.ctrs {
		if err := w.resolve(ctx, pod, c); err != nil {
			c.state, c.reason, c.message = stateWaiting, "CreateContainerError", err.Error()
			w.h.recorder.Eventf(pod, v1.EventTypeWarning, "Failed", "Error: %v", err)
			w.logger.Error(err, "Failed to create container", "container", c.spec.Name)
			return err
		}
	}
	return nil
}

// resolve computes a container's command line and environment: the container's own env
// (plain values, with $(VAR) expansion like the kubelet), then the CDI edits of the
// devices the DRA manager returns for the container, applied to an OCI spec by the CDI
// library. Writes <container>.cdi.json (device ids) and <container>.oci.json (the spec).
func (w *podWorker) resolve(ctx context.Context, pod *v1.Pod, c *ctr) error {
	logger := klog.LoggerWithValues(w.logger, "container", c.spec.Name)
	info, err := w.h.dra.GetResources(pod, c.spec)
	if err != nil {
		return err
	}
	devices := make([]string, 0, len(info.CDIDevices))
	for _, d := range info.CDIDevices {
		devices = append(devices, d.Name)
	}

	var envs []kubecontainer.EnvVar
	tmp := map[string]string{}
	mapping := expansion.MappingFuncFor(tmp)
	for _, e := range c.spec.Env {
		if e.ValueFrom != nil {
			logger.Info("Ignoring env var with valueFrom (not supported by the harness)", "name", e.Name)
			continue
		}
		v := expansion.Expand(e.Value, mapping)
		tmp[e.Name] = v
		envs = append(envs, kubecontainer.EnvVar{Name: e.Name, Value: v})
	}
	if len(c.spec.EnvFrom) > 0 {
		logger.Info("Ignoring envFrom (not supported by the harness)")
	}
	command, args := kubecontainer.ExpandContainerCommandAndArgs(c.spec, envs)
	c.argv = append(append([]string{}, command...), args...)
	if len(command) == 0 {
		c.startErr = "the kubelet harness runs only containers with a command (image entrypoints are not available)"
	}

	env := []string{"PATH=" + defaultPath, "HOSTNAME=" + pod.Name}
	for _, e := range envs {
		env = setEnv(env, e.Name, e.Value)
	}
	cwd := c.spec.WorkingDir
	if cwd == "" {
		cwd = "/"
	}
	spec := &oci.Spec{
		Version:  oci.Version,
		Hostname: pod.Name,
		Process:  &oci.Process{Args: c.argv, Env: env, Cwd: cwd},
		Linux:    &oci.Linux{},
	}
	if len(devices) > 0 {
		if w.h.cdi == nil {
			return fmt.Errorf("CDI devices %v requested but the CDI cache is unavailable", devices)
		}
		if err := w.h.cdi.inject(logger, spec, devices); err != nil {
			return fmt.Errorf("CDI device injection failed: %w", err)
		}
	}
	c.env = spec.Process.Env
	c.dir = c.spec.WorkingDir
	if c.dir == "" {
		c.dir = w.dir
	}
	logger.V(2).Info("Resolved container", "cdiDevices", devices, "argv", c.argv)
	writeJSON(logger, filepath.Join(w.dir, c.spec.Name+".cdi.json"), devices)
	writeJSON(logger, filepath.Join(w.dir, c.spec.Name+".oci.json"), spec)
	return nil
}

func writeJSON(logger klog.Logger, path string, v any) {
	data, err := json.MarshalIndent(v, "", "  ")
	if err == nil {
		tmp := path + ".tmp"
		if err = os.WriteFile(tmp, append(data, '\n'), 0o644); err == nil {
			err = os.Rename(tmp, path)
		}
	}
	if err != nil {
		logger.Error(err, "Writing file", "path", path)
	}
}

func (w *podWorker) startContainer(ctx context.Context, c *ctr) {
	pod := w.latest()
	now := time.Now()
	startErr := c.startErr
	if startErr == "" {
		p, err := startProcess(c.argv, c.env, c.dir, filepath.Join(w.dir, c.spec.Name+".log"),
			func(p *proc) { w.exitCh <- c })
		if err == nil {
			c.proc = p
			c.state, c.reason, c.message = stateRunning, "", ""
			c.startedAt = now
			c.id = fmt.Sprintf("harness://%s-%s-%d", w.uid, c.spec.Name, p.pid)
			w.h.recorder.Eventf(pod, v1.EventTypeNormal, "Started", "Started container %s", c.spec.Name)
			w.logger.Info("Started container", "container", c.spec.Name, "pid", p.pid, "argv", c.argv)
			return
		}
		startErr = err.Error()
	}
	// Like a runtime's StartError: the container counts as run and failed (exit code 128).
	c.state, c.reason, c.message = stateTerminated, "StartError", startErr
	c.exitCode = 128
	c.startedAt, c.finishedAt = now, now
	w.h.recorder.Eventf(pod, v1.EventTypeWarning, "Failed", "Error: %s", startErr)
	w.logger.Info("Failed to start container", "container", c.spec.Name, "err", startErr)
}

func (w *podWorker) containerExited(c *ctr) {
	if c.state == stateTerminated || c.proc == nil {
		return
	}
	c.state = stateTerminated
	c.exitCode = c.proc.exitCode
	c.finishedAt = c.proc.finishedAt
	c.reason, c.message = "Completed", ""
	if c.exitCode != 0 {
		c.reason = "Error"
	}
	w.logger.Info("Container exited", "container", c.spec.Name, "exitCode", c.exitCode)
}

// runUntilDone waits until all main containers have exited or termination is requested.
func (w *podWorker) runUntilDone(ctx context.Context) {
	for {
		w.syncStatus(ctx)
		if w.allMainTerminated() || w.terminationRequested() {
			return
		}
		select {
		case c := <-w.exitCh:
			w.containerExited(c)
		case <-w.wake:
		case <-w.healthWake:
		case <-ctx.Done():
			return
		}
	}
}

func (w *podWorker) allMainTerminated() bool {
	for _, c := range w.ctrs {
		if !c.init && c.state != stateTerminated {
			return false
		}
	}
	return true
}

// gracePeriod follows the kubelet: the deletion grace period if the pod is being deleted,
// else the pod's terminationGracePeriodSeconds; never below kuberuntime's minimum.
func (w *podWorker) gracePeriod() time.Duration {
	pod := w.latest()
	secs := int64(v1.DefaultTerminationGracePeriodSeconds)
	if pod.Spec.TerminationGracePeriodSeconds != nil {
		secs = *pod.Spec.TerminationGracePeriodSeconds
	}
	if pod.DeletionGracePeriodSeconds != nil {
		secs = *pod.DeletionGracePeriodSeconds
	}
	return max(time.Duration(secs)*time.Second, minimumGracePeriod)
}

// stopAll stops all running containers (SIGTERM, SIGKILL after grace) and records their exits.
func (w *podWorker) stopAll(grace time.Duration, recordEvents bool) {
	pod := w.latest()
	var wg sync.WaitGroup
	for _, c := range w.ctrs {
		if c.state != stateRunning || c.proc == nil {
			continue
		}
		if recordEvents {
			w.h.recorder.Eventf(pod, v1.EventTypeNormal, "Killing", "Stopping container %s", c.spec.Name)
		}
		w.logger.Info("Stopping container", "container", c.spec.Name, "gracePeriod", grace)
		wg.Add(1)
		go func(p *proc) {
			defer wg.Done()
			p.stop(grace)
		}(c.proc)
	}
	wg.Wait()
	for _, c := range w.ctrs {
		if c.state == stateRunning && c.proc != nil {
			<-c.proc.done
			w.containerExited(c)
		}
	}
	// Drain the exit notifications (containerExited ignores repeats).
	for {
		select {
		case c := <-w.exitCh:
			w.containerExited(c)
		default:
			return
		}
	}
}

// terminate is SyncTerminatingPod: stop the containers, then UnprepareResources (after all
// containers stopped and before the terminal status is written), then the terminal status,
// then (for a deleted pod) the final deletion with grace period 0.
func (w *podWorker) terminate(ctx context.Context) {
	w.stopAll(w.gracePeriod(), true)
	w.active.Store(false)
	w.unprepare(ctx)
	if ctx.Err() != nil {
		return
	}
	w.sandbox = false
	w.terminal = v1.PodSucceeded
	if w.initFailed || !w.mainStart {
		w.terminal = v1.PodFailed
	}
	for _, c := range w.ctrs {
		if !c.init && (c.state != stateTerminated || c.exitCode != 0) {
			w.terminal = v1.PodFailed
		}
	}
	w.logger.Info("Pod terminated", "phase", w.terminal)
	for !w.isRemoved() && !w.syncStatus(ctx) {
		if !w.sleep(ctx, time.Second) {
			return
		}
	}
}

// unprepare calls the DRA manager's UnprepareResources until it succeeds.
func (w *podWorker) unprepare(ctx context.Context) {
	backoff := time.Second
	for {
		err := w.h.dra.UnprepareResources(ctx, w.latest())
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			return
		}
		w.logger.Error(err, "Failed to unprepare dynamic resources, will retry", "backoff", backoff)
		if !w.isRemoved() {
			w.h.recorder.Eventf(w.latest(), v1.EventTypeWarning, "FailedUnprepareDynamicResources", "Failed to unprepare dynamic resources: %v", err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
		backoff = min(2*backoff, w.h.opts.maxBackoff)
	}
}

// idle waits for the pod to go away, finalizing its deletion once it is requested
// (SyncTerminatedPod + the status manager's final delete).
func (w *podWorker) idle(ctx context.Context) {
	for {
		if w.isRemoved() {
			w.logger.Info("Pod removed")
			return
		}
		if w.latest().DeletionTimestamp != nil && !w.finalized {
			w.finalizeDeletion(ctx)
		}
		var retry <-chan time.Time
		if w.latest().DeletionTimestamp != nil && !w.finalized {
			retry = time.After(time.Second)
		}
		select {
		case <-w.wake:
		case <-retry:
		case <-ctx.Done():
			return
		}
	}
}

func (w *podWorker) finalizeDeletion(ctx context.Context) {
	pod := w.latest()
	err := w.h.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0),
		Preconditions:      metav1.NewUIDPreconditions(string(pod.UID)),
	})
	switch {
	case err == nil:
		w.logger.Info("Pod fully terminated and removed from the API")
		w.finalized = true
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
		w.finalized = true
	default:
		w.logger.Error(err, "Deleting pod failed, will retry")
	}
}

// sleep waits for d; it returns false early if termination is requested or ctx ends.
func (w *podWorker) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			return true
		case <-w.wake:
			if w.terminationRequested() {
				return false
			}
		case <-ctx.Done():
			return false
		}
	}
}
