// Command karpenter-kwok is Karpenter (sigs.k8s.io/karpenter, the version go.mod pins) with its
// kwok cloud provider, whose GPU instance types carry flexgpu's node templates as
// InstanceType.DynamicResources, so that Karpenter's DRA scheduling simulation can provision
// nodes for pods with ResourceClaims. Tooling for tests, not part of flexgpu.
//
// Configured like Karpenter's own kwok binary (KUBECONFIG, INSTANCE_TYPES_FILE_PATH,
// IGNORE_DRA_REQUESTS, ... as environment or flags), plus one variable of its own:
//
//	FLEXGPU_DRA_TEMPLATES=FILE  a JSON object: instance type name -> what
//	                            `flexgpu node-template --format karpenter -o json` prints
//
// Every instance type named there must exist among the kwok instance types; a name that does not
// stops the process with an error, since a pool silently missing its devices would provision
// nothing for DRA claims.
package main

import (
	"context"
	"fmt"
	"os"
	"sort"

	"github.com/samber/lo"
	"sigs.k8s.io/controller-runtime/pkg/log"

	kwok "sigs.k8s.io/karpenter/kwok/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/cloudprovider/overlay"
	"sigs.k8s.io/karpenter/pkg/controllers"
	"sigs.k8s.io/karpenter/pkg/controllers/node/health"
	"sigs.k8s.io/karpenter/pkg/controllers/state"
	"sigs.k8s.io/karpenter/pkg/operator"

	"flexgpu.local/tools/karpenter/templates"
)

const templatesEnv = "FLEXGPU_DRA_TEMPLATES"

// withTemplates sets DynamicResources on each instance type the templates file names.
func withTemplates(ctx context.Context, instanceTypes []*cloudprovider.InstanceType, path string) error {
	var files map[string]templates.File
	if err := templates.ReadJSON(path, &files); err != nil {
		return fmt.Errorf("%s: %w", templatesEnv, err)
	}
	byName := lo.SliceToMap(instanceTypes, func(it *cloudprovider.InstanceType) (string, *cloudprovider.InstanceType) {
		return it.Name, it
	})
	names := lo.Keys(files)
	sort.Strings(names)
	for _, name := range names {
		it, ok := byName[name]
		if !ok {
			return fmt.Errorf("%s: instance type %q is not among the kwok instance types (%v)",
				templatesEnv, name, lo.Keys(byName))
		}
		it.DynamicResources = templates.DynamicResources(files[name])
		devices := 0
		for _, t := range it.DynamicResources.ResourceSliceTemplates {
			devices += len(t.Devices)
		}
		log.FromContext(ctx).Info("instance type carries DRA templates", "instance-type", name,
			"templates", len(it.DynamicResources.ResourceSliceTemplates), "devices", devices,
			"attribute-bindings", len(it.DynamicResources.AttributeBindings))
	}
	return nil
}

func main() {
	ctx, op := operator.NewOperator()
	instanceTypes, err := kwok.ConstructInstanceTypes(ctx)
	if err != nil {
		log.FromContext(ctx).Error(err, "failed constructing instance types")
		os.Exit(1)
	}
	if path := os.Getenv(templatesEnv); path != "" {
		if err := withTemplates(ctx, instanceTypes, path); err != nil {
			log.FromContext(ctx).Error(err, "failed reading DRA templates")
			os.Exit(1)
		}
	}
	// From here on as Karpenter's own kwok binary (sigs.k8s.io/karpenter/kwok/main.go) wires it.
	undecorated := kwok.NewCloudProvider(ctx, op.GetClient(), instanceTypes)
	cloudProvider := overlay.Decorate(undecorated, op.GetClient(), op.InstanceTypeStore)
	repairPolicyMatcher := lo.Must(health.NewRepairPolicyMatcher(ctx, cloudProvider))
	clusterState := state.NewCluster(op.Clock, op.GetClient(), cloudProvider, state.WithRepairPolicyMatcher(repairPolicyMatcher))
	op.
		WithControllers(ctx, controllers.NewControllers(
			ctx,
			op.Manager,
			op.Clock,
			op.GetClient(),
			op.EventRecorder,
			cloudProvider,
			undecorated,
			clusterState,
			op.InstanceTypeStore,
			op.PredictionStore,
		)...).Start(ctx)
}
