// Command kubelet-harness acts as "the kubelet" of one simulated node for flexgpu's
// integration and end-to-end tests. It is built from the upstream kubelet code: the
// plugin manager (socket watcher + registration) with the DRA manager's registration
// handler for plugin type DRAPlugin, and the DRA manager itself (checkpointed claim
// cache, NodePrepareResources / NodeUnprepareResources over the real gRPC API, health
// stream, ResourceSlice wiping). Only the container runtime is replaced: each container
// of a pod bound to the node runs as a local process (command + args), with the
// environment that the upstream CDI library produces for the container's CDI devices.
//
// See README.md next to this file.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/sets"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	_ "k8s.io/kubernetes/pkg/features" // registers the Kubernetes feature gates
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	kubeletconfig "k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

type options struct {
	kubeconfig    string
	nodeName      string
	rootDir       string
	registryDir   string
	pluginsDir    string
	cdiDir        string
	stateDir      string
	featureGates  string
	maxBackoff    time.Duration
	shutdownGrace time.Duration
	readyTimeout  time.Duration
}

func main() {
	os.Exit(run())
}

func run() int {
	opts := options{}
	fs := flag.NewFlagSet("kubelet-harness", flag.ExitOnError)
	fs.StringVar(&opts.kubeconfig, "kubeconfig", "", "Path to the kubeconfig used to reach the API server (required).")
	fs.StringVar(&opts.nodeName, "node-name", "", "Name of the Node object this harness acts as the kubelet for (required; the Node must exist).")
	fs.StringVar(&opts.rootDir, "root-dir", "", "Root folder of this simulated kubelet, like /var/lib/kubelet (required). "+
		"Holds plugins_registry/, plugins/, cdi/, dra-state/ and pods/<namespace>_<name>/<container>.log.")
	fs.StringVar(&opts.registryDir, "registry-dir", "", "Plugin registration folder watched by the plugin manager (default <root-dir>/plugins_registry).")
	fs.StringVar(&opts.pluginsDir, "plugins-dir", "", "Folder under which plugins put their service sockets, like /var/lib/kubelet/plugins (default <root-dir>/plugins). Only created; endpoints come from GetInfo.")
	fs.StringVar(&opts.cdiDir, "cdi-dir", "", "CDI spec folder read by the CDI cache, like /var/run/cdi (default <root-dir>/cdi).")
	fs.StringVar(&opts.stateDir, "state-dir", "", "Folder of the DRA manager's checkpoint (dra_manager_state) and health state (default <root-dir>/dra-state).")
	fs.StringVar(&opts.featureGates, "feature-gates", "", "Comma-separated key=value pairs of feature gates, as for the kubelet. Known gates:\n"+
		strings.Join(knownGates(), "\n"))
	fs.DurationVar(&opts.maxBackoff, "sync-backoff-max", 10*time.Second, "Cap of the exponential backoff (1s, 2s, 4s, ...) between retries of a failed prepare, container creation or unprepare; the kubelet's pod worker backoff is 10s.")
	fs.DurationVar(&opts.shutdownGrace, "shutdown-grace", 2*time.Second, "On SIGTERM/SIGINT, how long running containers get between SIGTERM and SIGKILL.")
	fs.DurationVar(&opts.readyTimeout, "ready-timeout", 2*time.Minute, "Give up (exit 1) when informers, the Node or the startup ResourceSlice wipe are not ready within this time.")
	klog.InitFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: kubelet-harness --kubeconfig FILE --node-name NODE --root-dir DIR [flags]\n\n"+
			"Acts as the kubelet of one simulated node: registers DRA plugins through the upstream plugin manager,\n"+
			"prepares/unprepares claims through the upstream DRA manager, runs pod containers as local processes.\n"+
			"Prints READY on stdout once it is serving. Logs (klog) go to stderr.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	_ = fs.Parse(os.Args[1:])
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "error: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if opts.kubeconfig == "" || opts.nodeName == "" || opts.rootDir == "" {
		fmt.Fprintln(os.Stderr, "error: --kubeconfig, --node-name and --root-dir are required")
		fs.Usage()
		return 2
	}
	if opts.featureGates != "" {
		if err := utilfeature.DefaultMutableFeatureGate.Set(opts.featureGates); err != nil {
			fmt.Fprintf(os.Stderr, "error: --feature-gates: %v\n", err)
			return 2
		}
	}
	defer klog.Flush()

	root, err := filepath.Abs(opts.rootDir)
	if err != nil {
		klog.ErrorS(err, "Invalid --root-dir")
		return 1
	}
	opts.rootDir = root
	def := func(v *string, sub string) {
		if *v == "" {
			*v = filepath.Join(root, sub)
		}
		if abs, err := filepath.Abs(*v); err == nil {
			*v = abs
		}
	}
	def(&opts.registryDir, "plugins_registry")
	def(&opts.pluginsDir, "plugins")
	def(&opts.cdiDir, "cdi")
	def(&opts.stateDir, "dra-state")
	podsDir := filepath.Join(root, "pods")
	for _, d := range []string{root, opts.registryDir, opts.pluginsDir, opts.cdiDir, opts.stateDir, podsDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			klog.ErrorS(err, "Creating folder", "path", d)
			return 1
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logger := klog.LoggerWithValues(klog.Background(), "node", opts.nodeName)
	ctx = klog.NewContext(ctx, logger)

	sigCh := make(chan os.Signal, 2)
	signal.Notify(sigCh, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-sigCh
		logger.Info("Received signal, shutting down", "signal", sig.String())
		cancel()
		<-sigCh
		logger.Info("Second signal, exiting immediately")
		os.Exit(1)
	}()

	restConfig, err := clientcmd.BuildConfigFromFlags("", opts.kubeconfig)
	if err != nil {
		logger.Error(err, "Loading kubeconfig", "path", opts.kubeconfig)
		return 1
	}
	restConfig.UserAgent = "kubelet-harness/" + opts.nodeName
	restConfig.QPS = 50
	restConfig.Burst = 100
	wipe := newWipeObserver(opts.nodeName)
	restConfig.Wrap(wipe.wrap)
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		logger.Error(err, "Creating API client")
		return 1
	}

	broadcaster := record.NewBroadcaster(record.WithContext(klog.NewContext(context.Background(), logger)))
	broadcaster.StartStructuredLogging(3)
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	recorder := broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: opts.nodeName})
	defer broadcaster.Shutdown()

	nodeFactory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", opts.nodeName).String()
		}))
	podFactory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", opts.nodeName).String()
		}))
	nodeLister := nodeFactory.Core().V1().Nodes().Lister()
	podInformer := podFactory.Core().V1().Pods().Informer()
	nodeInformer := nodeFactory.Core().V1().Nodes().Informer()

	// The upstream DRA manager, exactly as container_manager_linux.go creates it, but with
	// its checkpoint in our state dir instead of the kubelet root dir.
	draManager, err := dra.NewManager(logger, client, opts.stateDir)
	if err != nil {
		logger.Error(err, "Creating the DRA manager")
		return 1
	}

	h := newHarness(ctx, &opts, podsDir, client, recorder, draManager, nodeLister)
	if _, err := podInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { h.podChanged(obj) },
		UpdateFunc: func(_, obj any) { h.podChanged(obj) },
		DeleteFunc: func(obj any) { h.podRemoved(obj) },
	}); err != nil {
		logger.Error(err, "Adding pod event handler")
		return 1
	}

	nodeFactory.Start(ctx.Done())
	podFactory.Start(ctx.Done())
	defer nodeFactory.Shutdown()
	defer podFactory.Shutdown()

	readyCtx, readyCancel := context.WithTimeout(ctx, opts.readyTimeout)
	defer readyCancel()
	if !cache.WaitForCacheSync(readyCtx.Done(), podInformer.HasSynced, nodeInformer.HasSynced) {
		if ctx.Err() != nil {
			return 0
		}
		logger.Error(nil, "Informers did not sync", "timeout", opts.readyTimeout)
		return 1
	}

	// Like the kubelet: the pods source is "seen" once the informer has synced.
	sourcesReady := kubeletconfig.NewSourcesReady(func(_ sets.Set[string]) bool { return podInformer.HasSynced() })
	getNode := func(context.Context) (*v1.Node, error) { return nodeLister.Get(opts.nodeName) }
	// Start creates the DRA plugin manager (registration handler), which wipes all
	// ResourceSlices of this node in the background, and starts the 60s reconcile loop.
	if err := draManager.Start(ctx, h.activePods, getNode, sourcesReady); err != nil {
		logger.Error(err, "Starting the DRA manager")
		return 1
	}
	defer draManager.Stop()

	// The upstream plugin manager, as kubelet.go creates and runs it, with the DRA
	// handler registered the way containerManager.GetPluginRegistrationHandlers does.
	pm := pluginmanager.NewPluginManager(opts.registryDir, recorder)
	pm.AddHandler(pluginwatcherapi.DRAPlugin, draManager.GetWatcherHandler())
	pmDone := make(chan struct{})
	go func() {
		defer close(pmDone)
		pm.Run(ctx, sourcesReady, ctx.Done())
	}()

	go h.forwardHealthUpdates(draManager.Updates())

	// Wait until the DRA plugin manager's startup wipe has deleted this node's slices, so that
	// a plugin started after READY never has its fresh slices deleted by it.
	if !wipe.wait(readyCtx, func() {
		if _, err := nodeLister.Get(opts.nodeName); err != nil {
			logger.Info("Waiting for the Node object before the startup ResourceSlice wipe can run", "err", err)
		} else {
			logger.Info("Waiting for the startup ResourceSlice wipe")
		}
	}) {
		if ctx.Err() != nil {
			return 0
		}
		logger.Error(nil, "Startup ResourceSlice wipe did not happen (does the Node exist?)", "timeout", opts.readyTimeout)
		return 1
	}

	h.start()
	logger.Info("Kubelet harness ready", "registryDir", opts.registryDir, "pluginsDir", opts.pluginsDir,
		"cdiDir", opts.cdiDir, "stateDir", opts.stateDir, "podsDir", podsDir)
	fmt.Fprintln(os.Stdout, "READY")
	_ = os.Stdout.Sync()

	<-ctx.Done()
	logger.Info("Stopping pod workers")
	h.wait()
	<-pmDone
	logger.Info("Kubelet harness stopped")
	return 0
}

func knownGates() []string {
	gates := utilfeature.DefaultMutableFeatureGate.KnownFeatures()
	out := make([]string, 0, len(gates))
	for _, g := range gates {
		out = append(out, "  "+g)
	}
	return out
}
