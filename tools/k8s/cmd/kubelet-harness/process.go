package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// The container "runtime": each container is one local process (command + args, the image
// is ignored) in its own process group, with stdout and stderr appended to its log file.

type spawnRequest struct {
	cmd    *exec.Cmd
	result chan error
}

var spawnCh = make(chan spawnRequest)

// All processes are started from one goroutine locked to one OS thread that never exits,
// so that Pdeathsig (SIGKILL to the child when its parent thread dies) only fires when the
// harness itself dies, e.g. killed with SIGKILL: no container outlives the harness.
func init() {
	go func() {
		runtime.LockOSThread()
		for req := range spawnCh {
			req.result <- req.cmd.Start()
		}
	}()
}

// proc is one running container process.
type proc struct {
	pid        int
	done       chan struct{} // closed once the process has exited and been reaped
	exitCode   int32
	finishedAt time.Time
}

// startProcess starts argv with exactly env (nothing is inherited from the harness) in dir.
// onExit is called (from another goroutine) after the process has exited.
func startProcess(argv, env []string, dir, logPath string, onExit func(*proc)) (*proc, error) {
	if len(argv) == 0 {
		return nil, errors.New("no command")
	}
	path, err := lookPath(argv[0], env, dir)
	if err != nil {
		return nil, err
	}
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open container log: %w", err)
	}
	defer logFile.Close() // the child has its own copy of the descriptor
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		return nil, err
	}
	defer devNull.Close()
	cmd := &exec.Cmd{
		Path:   path,
		Args:   argv,
		Env:    env,
		Dir:    dir,
		Stdin:  devNull,
		Stdout: logFile,
		Stderr: logFile,
		SysProcAttr: &syscall.SysProcAttr{
			Setpgid:   true,
			Pdeathsig: syscall.SIGKILL,
		},
	}
	req := spawnRequest{cmd: cmd, result: make(chan error, 1)}
	spawnCh <- req
	if err := <-req.result; err != nil {
		return nil, err
	}
	p := &proc{pid: cmd.Process.Pid, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		p.finishedAt = time.Now()
		p.exitCode = exitCode(cmd.ProcessState)
		// When a container's main process exits, the runtime tears down its whole PID
		// namespace; do the same for whatever the process left in its group.
		_ = syscall.Kill(-p.pid, syscall.SIGKILL)
		close(p.done)
		if onExit != nil {
			onExit(p)
		}
	}()
	return p, nil
}

// stop sends SIGTERM to the process group, then SIGKILL after grace, and waits for the exit.
func (p *proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = syscall.Kill(-p.pid, syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
		return
	case <-t.C:
	}
	_ = syscall.Kill(-p.pid, syscall.SIGKILL)
	<-p.done
}

// exitCode follows container runtimes: a process killed by signal N exits with 128+N.
func exitCode(ps *os.ProcessState) int32 {
	if ps == nil {
		return -1
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok {
		if ws.Signaled() {
			return int32(128 + int(ws.Signal()))
		}
		return int32(ws.ExitStatus())
	}
	return int32(ps.ExitCode())
}

// lookPath resolves the command like a runtime does inside the container: through the
// container's own PATH, not the harness's.
func lookPath(file string, env []string, dir string) (string, error) {
	if strings.Contains(file, "/") {
		p := file
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := executable(p); err != nil {
			return "", fmt.Errorf("exec: %q: %w", file, err)
		}
		return p, nil
	}
	for _, d := range filepath.SplitList(getEnv(env, "PATH")) {
		if d == "" {
			continue
		}
		p := filepath.Join(d, file)
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("exec: %q: executable file not found in $PATH", file)
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return errors.New("permission denied")
	}
	return nil
}

func getEnv(env []string, key string) string {
	for i := len(env) - 1; i >= 0; i-- {
		if k, v, ok := strings.Cut(env[i], "="); ok && k == key {
			return v
		}
	}
	return ""
}

// setEnv replaces key's entry in env, or appends it.
func setEnv(env []string, key, value string) []string {
	for i, kv := range env {
		if k, _, ok := strings.Cut(kv, "="); ok && k == key {
			env[i] = key + "=" + value
			return env
		}
	}
	return append(env, key+"="+value)
}
