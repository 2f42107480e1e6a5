package main

// Mutable GPU state shared by every process that loads this library, in one JSON file:
// NVIDIA's mock servers keep MIG instances in memory, which a plugin restart would lose.
// Each call takes an exclusive flock, reads the file, and replaces it atomically if it changed.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

type computeInstance struct {
	ID           int    `json:"id"`
	ProfileIndex int    `json:"profileIndex"`
	UUID         string `json:"uuid"`
}

type gpuInstance struct {
	ID               int               `json:"id"`
	ProfileIndex     int               `json:"profileIndex"`
	Start            int               `json:"start"`
	Size             int               `json:"size"`
	ComputeInstances []computeInstance `json:"computeInstances"`
}

type process struct {
	Pid               int    `json:"pid"`
	UsedMiB           int    `json:"usedMiB"`
	GpuInstanceID     *int   `json:"gpuInstanceId,omitempty"`
	ComputeInstanceID *int   `json:"computeInstanceId,omitempty"`
	SmUtil            *int   `json:"smUtil,omitempty"`
	MemUtil           *int   `json:"memUtil,omitempty"`
	TimeStampUs       uint64 `json:"timeStampUs,omitempty"`
}

type gpuState struct {
	MigMode      int           `json:"migMode"`
	ComputeMode  int           `json:"computeMode"`
	Lost         bool          `json:"lost"`
	GpuInstances []gpuInstance `json:"gpuInstances"`
	Processes    []process     `json:"processes"`
}

type event struct {
	Seq               uint64 `json:"seq"`
	UUID              string `json:"uuid"`
	Type              uint64 `json:"type"`
	Data              uint64 `json:"data"`
	GpuInstanceID     uint32 `json:"gpuInstanceId"`
	ComputeInstanceID uint32 `json:"computeInstanceId"`
}

type state struct {
	Gpus    map[string]*gpuState `json:"gpus"`
	Events  []event              `json:"events"`
	NextSeq uint64               `json:"nextSeq"`
}

// keepEvents bounds the event log; readers far behind lose the oldest events, as NVML's own
// per-set queue would overflow.
const keepEvents = 1024

func (s *state) gpu(m *machine, g *gpu) *gpuState {
	if s.Gpus == nil {
		s.Gpus = map[string]*gpuState{}
	}
	st, ok := s.Gpus[g.uuid]
	if !ok {
		st = &gpuState{}
		if g.migDefault && g.migCapable() {
			st.MigMode = 1
		}
		s.Gpus[g.uuid] = st
	}
	return st
}

func (s *state) addEvent(e event) {
	if s.NextSeq == 0 {
		s.NextSeq = 1
	}
	e.Seq = s.NextSeq
	s.NextSeq++
	s.Events = append(s.Events, e)
	if len(s.Events) > keepEvents {
		s.Events = s.Events[len(s.Events)-keepEvents:]
	}
}

// withState runs fn on the state file under an exclusive lock and writes the result back when
// fn reports a change. The write is a rename of a synced temporary file, so a process killed
// mid-write leaves the previous state.
func withState(path string, fn func(*state) (bool, error)) error {
	lock, err := os.OpenFile(path+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) //nolint:errcheck

	var s state
	raw, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return err
	default:
		if err := json.Unmarshal(raw, &s); err != nil {
			return fmt.Errorf("state file %s: %w", path, err)
		}
	}
	changed, err := fn(&s)
	if err != nil || !changed {
		return err
	}
	data, err := json.MarshalIndent(&s, "", " ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
