// Package templates reads what `flexgpu node-template --format karpenter -o json` prints into
// Karpenter's cloudprovider.DynamicResources. Tooling for tests, not part of flexgpu.
package templates

import (
	"encoding/json"
	"fmt"
	"os"
	"unique"

	resourcev1 "k8s.io/api/resource/v1"

	"sigs.k8s.io/karpenter/pkg/cloudprovider"
)

// File is the shape flexgpu prints (field names of Karpenter's Go types in camelCase, as
// those types carry no JSON tags).
type File struct {
	ResourceSliceTemplates []struct {
		Driver string `json:"driver"`
		Pool   struct {
			Name string `json:"name"`
		} `json:"pool"`
		Devices []struct {
			Name                     string                                                  `json:"name"`
			Attributes               map[resourcev1.QualifiedName]resourcev1.DeviceAttribute `json:"attributes"`
			Capacity                 map[resourcev1.QualifiedName]resourcev1.DeviceCapacity  `json:"capacity"`
			AllowMultipleAllocations bool                                                    `json:"allowMultipleAllocations"`
			ConsumesCounters         []resourcev1.DeviceCounterConsumption                   `json:"consumesCounters"`
		} `json:"devices"`
		SharedCounters []resourcev1.CounterSet `json:"sharedCounters"`
	} `json:"resourceSliceTemplates"`
	AttributeBindings []struct {
		Attribute resourcev1.QualifiedName `json:"attribute"`
		Devices   []struct {
			Driver string `json:"driver"`
			Pool   string `json:"pool"`
			Device string `json:"device"`
		} `json:"devices"`
	} `json:"attributeBindings"`
}

// ReadJSON decodes one JSON file, naming the file in any error.
func ReadJSON(path string, into any) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, into); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// DynamicResources converts one instance type's templates into Karpenter's types.
func DynamicResources(file File) cloudprovider.DynamicResources {
	var out cloudprovider.DynamicResources
	for _, t := range file.ResourceSliceTemplates {
		template := &cloudprovider.ResourceSliceTemplate{
			Driver:         unique.Make(t.Driver),
			Pool:           cloudprovider.ResourcePool{Name: unique.Make(t.Pool.Name)},
			SharedCounters: t.SharedCounters,
		}
		for _, d := range t.Devices {
			template.Devices = append(template.Devices, cloudprovider.Device{
				Name:                     unique.Make(d.Name),
				Attributes:               d.Attributes,
				Capacity:                 d.Capacity,
				AllowMultipleAllocations: d.AllowMultipleAllocations,
				ConsumesCounters:         d.ConsumesCounters,
			})
		}
		out.ResourceSliceTemplates = append(out.ResourceSliceTemplates, template)
	}
	for _, b := range file.AttributeBindings {
		binding := &cloudprovider.AttributeBinding{Attribute: b.Attribute}
		for _, d := range b.Devices {
			binding.Devices = append(binding.Devices, cloudprovider.DeviceID{
				Driver: unique.Make(d.Driver), Pool: unique.Make(d.Pool), Device: unique.Make(d.Device),
			})
		}
		out.AttributeBindings = append(out.AttributeBindings, binding)
	}
	return out
}
