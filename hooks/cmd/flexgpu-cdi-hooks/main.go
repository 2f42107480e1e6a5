// flexgpu-cdi-hooks runs several of the NVIDIA Container Toolkit's CDI hooks (the subcommands
// of nvidia-cdi-hook) one after another in one process. A container that gets the driver runs
// five such hooks (symlinks, ld cache, CUDA compat, device node modification, application
// profile); as separate hooks that is five starts of a Go program on every container start,
// which this cuts to one. Each hook is the toolkit's own code, run with the arguments NVIDIA's
// generator gave it and the container state the runtime passed on stdin, in the order given;
// the first that fails ends the run with its error, as the runtime would have stopped there.
//
// Usage: flexgpu-cdi-hooks '<hook args as a JSON list>' ...
// for example '["create-symlinks","--link","libcuda.so.1::/usr/lib/libcuda.so"]'. A list
// per hook, so that no argument needs escaping and none can be taken for a separator.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/sirupsen/logrus"
	cli "github.com/urfave/cli/v3"

	"github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook/commands"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "flexgpu-cdi-hooks: no hook given; each argument is one hook's arguments as a JSON list")
		os.Exit(2)
	}
	hooks := make([][]string, 0, len(os.Args)-1)
	for _, arg := range os.Args[1:] {
		var args []string
		if err := json.Unmarshal([]byte(arg), &args); err != nil || len(args) == 0 {
			fmt.Fprintf(os.Stderr, "flexgpu-cdi-hooks: argument %q is not a non-empty JSON list of strings (one hook's arguments)\n", arg)
			os.Exit(2)
		}
		hooks = append(hooks, args)
	}
	state, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintf(os.Stderr, "flexgpu-cdi-hooks: reading the container state from stdin: %v\n", err)
		os.Exit(1)
	}
	logger := logrus.New()
	for _, args := range hooks {
		if err := run(logger, state, args); err != nil {
			logger.Errorf("%s: %v", args[0], err)
			os.Exit(1)
		}
	}
}

// run runs one hook as nvidia-cdi-hook would, with the container state on its stdin.
func run(logger *logrus.Logger, state []byte, args []string) error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer r.Close()
	// Written from a goroutine: a state larger than the pipe's buffer must not block.
	go func() {
		_, _ = w.Write(state)
		_ = w.Close()
	}()
	os.Stdin = r
	debug, quiet := false, false
	// The same flags and level rules as nvidia-cdi-hook's own main, on a fresh command: a
	// command keeps what it parsed, so none is reused.
	c := commands.ConfigureCDIHookCommand(logger, &cli.Command{
		Name: "nvidia-cdi-hook",
		Before: func(ctx context.Context, cmd *cli.Command) (context.Context, error) {
			level := logrus.InfoLevel
			if debug {
				level = logrus.DebugLevel
			}
			if quiet {
				level = logrus.ErrorLevel
			}
			logger.SetLevel(level)
			return ctx, nil
		},
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "debug", Aliases: []string{"d"}, Destination: &debug,
				Sources: cli.EnvVars("NVIDIA_CTK_DEBUG", "NVIDIA_CDI_DEBUG")},
			&cli.BoolFlag{Name: "quiet", Destination: &quiet,
				Sources: cli.EnvVars("NVIDIA_CTK_QUIET", "NVIDIA_CDI_QUIET")},
		},
	})
	return c.Run(context.Background(), append([]string{"nvidia-cdi-hook"}, args...))
}
