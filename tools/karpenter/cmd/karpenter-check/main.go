// Command karpenter-check runs Karpenter's own DRA allocator (sigs.k8s.io/karpenter
// pkg/scheduling/dynamicresources) on one instance type whose DynamicResources are what
// `flexgpu node-template --format karpenter -o json` prints, for each ResourceClaim of a file:
// would Karpenter's scheduling simulation place the claim on a new node of that type?
//
//	karpenter-check --templates T.json --classes C.json --claims CLAIMS.json
//
// classes and claims are JSON lists of resource.k8s.io/v1 DeviceClasses and ResourceClaims.
// Claims are read as the API server stores them (allocationMode and count set: no defaulting
// happens here). Each claim is tried alone on a fresh in-flight node; one line per claim on
// stdout: "NAME allocatable: DEVICE..." or "NAME unallocatable: WHY". Tooling for tests, not
// part of flexgpu.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"unique"

	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/scheduling"
	"sigs.k8s.io/karpenter/pkg/scheduling/dynamicresources"

	"flexgpu.local/tools/karpenter/templates"
)

const (
	nodePool     = "gpu-pool"
	instanceType = "gpu-instance"
)

// An in-flight NodeClaim of the one instance type: no node yet, devices from templates only.
type newNode struct {
	slices []dynamicresources.ResourceSlice
}

func (n newNode) ID() dynamicresources.NodeClaimID        { return unique.Make("new-node") }
func (n newNode) NodeName() string                        { return "" }
func (n newNode) NodePoolID() dynamicresources.NodePoolID { return unique.Make(nodePool) }
func (n newNode) Requirements() scheduling.Requirements   { return scheduling.NewRequirements() }
func (n newNode) InstanceTypes() []dynamicresources.InstanceTypeID {
	return []dynamicresources.InstanceTypeID{unique.Make(instanceType)}
}
func (n newNode) ResourceSlices() map[dynamicresources.InstanceTypeID][]dynamicresources.ResourceSlice {
	return map[dynamicresources.InstanceTypeID][]dynamicresources.ResourceSlice{unique.Make(instanceType): n.slices}
}

func run(templatesPath, classesPath, claimsPath string) error {
	var file templates.File
	var classes []resourcev1.DeviceClass
	var claims []resourcev1.ResourceClaim
	for path, into := range map[string]any{templatesPath: &file, classesPath: &classes, claimsPath: &claims} {
		if err := templates.ReadJSON(path, into); err != nil {
			return err
		}
	}
	it := &cloudprovider.InstanceType{Name: instanceType, DynamicResources: templates.DynamicResources(file)}
	bindings := dynamicresources.BuildAttributeBindings(map[string][]*cloudprovider.InstanceType{nodePool: {it}})
	scheme := runtime.NewScheme()
	if err := resourcev1.AddToScheme(scheme); err != nil {
		return err
	}
	objects := make([]client.Object, 0, len(classes))
	for i := range classes {
		objects = append(objects, &classes[i])
	}
	kube := fake.NewClientBuilder().WithScheme(scheme).WithObjects(objects...).Build()
	var slices []dynamicresources.ResourceSlice
	for _, t := range it.DynamicResources.ResourceSliceTemplates {
		slices = append(slices, dynamicresources.NewTemplateSlice(t))
	}
	ctx := context.Background()
	for i := range claims {
		claim := &claims[i]
		state := dynamicresources.AllocatedDeviceState{ExclusiveDevices: sets.New[cloudprovider.DeviceID]()}
		allocator := dynamicresources.NewAllocator(nil, state, bindings, kube, nil)
		key := types.NamespacedName{Namespace: claim.Namespace, Name: claim.Name}
		result, err := allocator.Allocate(ctx, newNode{slices: slices}, []*resourcev1.ResourceClaim{claim})
		switch {
		case err != nil:
			fmt.Printf("%s unallocatable: %v\n", claim.Name, err)
		case result == nil || len(result.InstanceTypes) == 0:
			fmt.Printf("%s unallocatable: no instance type fits\n", claim.Name)
		default:
			result.Allocation.Commit(ctx)
			var devices []string
			if meta := allocator.ResourceClaimAllocationMetadataForClaim(key); meta != nil {
				for _, results := range meta.Devices {
					for _, r := range results {
						devices = append(devices, r.DeviceID.Device.Value())
					}
				}
			}
			sort.Strings(devices)
			fmt.Printf("%s allocatable: %s\n", claim.Name, strings.Join(devices, " "))
		}
	}
	return nil
}

func main() {
	templates := flag.String("templates", "", "flexgpu node-template --format karpenter -o json output")
	classes := flag.String("classes", "", "JSON list of DeviceClasses")
	claims := flag.String("claims", "", "JSON list of ResourceClaims")
	flag.Parse()
	if *templates == "" || *classes == "" || *claims == "" {
		fmt.Fprintln(os.Stderr, "karpenter-check: --templates, --classes and --claims are required")
		os.Exit(2)
	}
	if err := run(*templates, *classes, *claims); err != nil {
		fmt.Fprintf(os.Stderr, "karpenter-check: %v\n", err)
		os.Exit(1)
	}
}
