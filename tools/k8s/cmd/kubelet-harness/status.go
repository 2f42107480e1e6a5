package main

import (
	"context"
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apipod "k8s.io/kubernetes/pkg/api/v1/pod"
	podutil "k8s.io/kubernetes/pkg/util/pod"
	"k8s.io/utils/ptr"
)

// syncStatus writes the pod status computed from the worker's state through the
// pods/status subresource, with the kubelet status manager's strategic merge patch
// (PatchPodStatus, UID precondition). It returns true when the API server holds that
// status (or the pod is gone).
func (w *podWorker) syncStatus(ctx context.Context) bool {
	if w.isRemoved() {
		return true
	}
	cached := w.latest()
	if apiequality.Semantic.DeepEqual(cached.Status, w.generateStatus(cached)) {
		return true
	}
	for attempt := 0; attempt < 3; attempt++ {
		fresh, err := w.h.client.CoreV1().Pods(cached.Namespace).Get(ctx, cached.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || (err == nil && fresh.UID != w.uid) {
			return true
		}
		if err != nil {
			w.logger.V(2).Info("Getting pod for status update failed", "err", err)
			if ctx.Err() != nil {
				return false
			}
			time.Sleep(200 * time.Millisecond)
			continue
		}
		status := w.generateStatus(fresh)
		if apiequality.Semantic.DeepEqual(fresh.Status, status) {
			return true
		}
		_, patch, _, err := podutil.PatchPodStatus(ctx, w.h.client, fresh.Namespace, fresh.Name, fresh.UID, fresh.Status, status)
		if err == nil {
			w.logger.V(3).Info("Patched pod status", "phase", status.Phase, "patch", string(patch))
			return true
		}
		if apierrors.IsNotFound(err) {
			return true
		}
		w.logger.Info("Patching pod status failed", "err", err, "attempt", attempt+1)
		if ctx.Err() != nil {
			return false
		}
		time.Sleep(200 * time.Millisecond)
	}
	return false
}

// generateStatus is the harness's generateAPIPodStatus: it starts from the pod's current
// status (keeping what others own, e.g. resourceClaimStatuses, qosClass) and sets phase,
// conditions, message, start time, host IPs and container statuses.
func (w *podWorker) generateStatus(pod *v1.Pod) v1.PodStatus {
	s := *pod.Status.DeepCopy()
	switch {
	case w.terminal != "":
		s.Phase = w.terminal
	case w.mainStart:
		s.Phase = v1.PodRunning
	default:
		s.Phase = v1.PodPending
	}
	if isTerminalPhase(pod.Status.Phase) && len(w.ctrs) == 0 {
		// A pod that was terminal before the harness saw it: nothing of ours to report.
		return s
	}
	s.Message, s.Reason = w.message, w.reason
	s.ObservedGeneration = apipod.CalculatePodStatusObservedGeneration(pod)
	if !w.startTime.IsZero() {
		s.StartTime = ptr.To(w.startTime)
	}
	if node, err := w.h.nodeLister.Get(w.h.opts.nodeName); err == nil {
		var ips []v1.HostIP
		for _, a := range node.Status.Addresses {
			if a.Type == v1.NodeInternalIP {
				ips = append(ips, v1.HostIP{IP: a.Address})
			}
		}
		if len(ips) > 0 {
			s.HostIP, s.HostIPs = ips[0].IP, ips
		}
	}

	s.InitContainerStatuses, s.ContainerStatuses = nil, nil
	for _, c := range w.ctrs {
		cs := w.containerStatus(c)
		if c.init {
			s.InitContainerStatuses = append(s.InitContainerStatuses, cs)
		} else {
			s.ContainerStatuses = append(s.ContainerStatuses, cs)
		}
	}

	// Conditions, as the kubelet's status generation sets them.
	var notInit, notReady []string
	for _, c := range w.ctrs {
		if c.init && !(c.state == stateTerminated && c.exitCode == 0) {
			notInit = append(notInit, c.spec.Name)
		}
		if !c.init && c.state != stateRunning {
			notReady = append(notReady, c.spec.Name)
		}
	}
	ready := func(t v1.PodConditionType, ok bool, reason, msg string) {
		c := v1.PodCondition{Type: t, Status: v1.ConditionFalse, Reason: reason, Message: msg,
			ObservedGeneration: apipod.CalculatePodConditionObservedGeneration(&pod.Status, pod.Generation, t)}
		if ok {
			c.Status, c.Reason, c.Message = v1.ConditionTrue, "", ""
		}
		w.setCondition(&s, c)
	}
	list := func(names []string) string { return "[" + strings.Join(names, " ") + "]" }
	ready(v1.PodReadyToStartContainers, w.sandbox, "", "")
	if len(notInit) == 0 || w.terminal == v1.PodSucceeded {
		ready(v1.PodInitialized, true, "", "")
	} else {
		ready(v1.PodInitialized, false, "ContainersNotInitialized", "containers with incomplete status: "+list(notInit))
	}
	switch {
	case w.terminal != "":
		ready(v1.ContainersReady, false, "PodCompleted", "")
		ready(v1.PodReady, false, "PodCompleted", "")
	case len(notReady) > 0:
		msg := "containers with unready status: " + list(notReady)
		ready(v1.ContainersReady, false, "ContainersNotReady", msg)
		ready(v1.PodReady, false, "ContainersNotReady", msg)
	default:
		ready(v1.ContainersReady, true, "", "")
		ready(v1.PodReady, true, "", "")
	}
	sort.SliceStable(s.Conditions, func(i, j int) bool {
		return conditionOrder(s.Conditions[i].Type) < conditionOrder(s.Conditions[j].Type)
	})

	if w.prepared && w.terminal == "" {
		// allocatedResourcesStatus (device health) comes from the DRA manager.
		w.h.dra.UpdateAllocatedResourcesStatus(w.logger, pod, &s)
	}
	return s
}

func conditionOrder(t v1.PodConditionType) int {
	for i, c := range []v1.PodConditionType{v1.PodReadyToStartContainers, v1.PodInitialized, v1.PodReady, v1.ContainersReady, v1.PodScheduled} {
		if c == t {
			return i
		}
	}
	return 100
}

// setCondition replaces or adds the condition, keeping lastTransitionTime when the status
// did not change (the kubelet's semantics).
func (w *podWorker) setCondition(s *v1.PodStatus, c v1.PodCondition) {
	c.LastTransitionTime = rfc(time.Now())
	if prev, ok := w.conds[c.Type]; ok && prev.Status == c.Status {
		c.LastTransitionTime = prev.LastTransitionTime
	}
	for i := range s.Conditions {
		if s.Conditions[i].Type == c.Type {
			if s.Conditions[i].Status == c.Status {
				c.LastTransitionTime = s.Conditions[i].LastTransitionTime
			}
			c.LastProbeTime = s.Conditions[i].LastProbeTime
			s.Conditions[i] = c
			w.conds[c.Type] = c
			return
		}
	}
	s.Conditions = append(s.Conditions, c)
	w.conds[c.Type] = c
}

func (w *podWorker) containerStatus(c *ctr) v1.ContainerStatus {
	cs := v1.ContainerStatus{
		Name:        c.spec.Name,
		Image:       c.spec.Image,
		ImageID:     "",
		ContainerID: c.id,
	}
	switch c.state {
	case stateWaiting:
		cs.State.Waiting = &v1.ContainerStateWaiting{Reason: c.reason, Message: c.message}
		cs.Started = ptr.To(false)
	case stateRunning:
		cs.State.Running = &v1.ContainerStateRunning{StartedAt: rfc(c.startedAt)}
		cs.Ready = !c.init
		cs.Started = ptr.To(true)
	case stateTerminated:
		cs.State.Terminated = &v1.ContainerStateTerminated{
			ExitCode:    c.exitCode,
			Reason:      c.reason,
			Message:     c.message,
			StartedAt:   rfc(c.startedAt),
			FinishedAt:  rfc(c.finishedAt),
			ContainerID: c.id,
		}
		cs.Started = ptr.To(false)
	}
	return cs
}

// rfc drops what the API does not store (sub-second precision, monotonic clock), so a
// generated status compares equal to the one read back.
func rfc(t time.Time) metav1.Time { return metav1.NewTime(t).Rfc3339Copy() }
