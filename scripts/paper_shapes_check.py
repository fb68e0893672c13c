#!/usr/bin/python3
"""Cross-checks `dkfac plan`'s paper-scale layer tables against torchvision's modules.

For resnet50, resnet152 and densenet201 this builds torchvision's model, records every Conv2d's and
Linear's K-FAC shape from one forward of a 1x3x224x224 zero image (a = C_in*kh*kw or in_features, +1
with a bias; g = C_out or out_features; rows per sample = H_out*W_out, 1 for a Linear) and compares the
list, name by name, and the total parameter count with `dkfac plan --model M --nproc 1 --json`.
Needs the Debian python3-torchvision package (hence /usr/bin/python3). Exit status 1 on any mismatch.

    /usr/bin/python3 scripts/paper_shapes_check.py [--dkfac build/dkfac]
"""
import argparse
import json
import subprocess
import sys

import torch
import torchvision


def torchvision_shapes(name):
    model = getattr(torchvision.models, name)().eval()
    shapes = []
    kinds = {"Conv2d": 0, "Linear": 0}

    def hook(module_name):
        def record(module, inputs, output):
            kinds[type(module).__name__] += 1
            if isinstance(module, torch.nn.Conv2d):
                a = module.in_channels * module.kernel_size[0] * module.kernel_size[1] // module.groups
                rows = output.shape[2] * output.shape[3]
                shapes.append((module_name, a + (module.bias is not None), module.out_channels, rows))
            else:
                shapes.append((module_name, module.in_features + (module.bias is not None), module.out_features, 1))
        return record

    for module_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
            module.register_forward_hook(hook(module_name))
    with torch.no_grad():
        model(torch.zeros(1, 3, 224, 224))
    parameters = sum(p.numel() for p in model.parameters())
    return shapes, parameters, kinds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dkfac", default="build/dkfac")
    args = parser.parse_args()
    failed = False
    for name in ["resnet50", "resnet152", "densenet201"]:
        expected, parameters, kinds = torchvision_shapes(name)
        out = subprocess.run([args.dkfac, "plan", "--model", name, "--nproc", "1", "--json"], check=True,
                             capture_output=True, text=True).stdout
        plan = json.loads(out)
        got = [(l["name"], l["a_dim"], l["g_dim"], l["rows_per_sample"]) for l in plan["layers"]]
        # torchvision hooks fire in forward order, which is the tables' order.
        mismatches = [(e, g) for e, g in zip(expected, got) if e != g]
        ok = len(expected) == len(got) and not mismatches and plan["parameters"] == parameters
        print(f"{name}: torchvision {len(expected)} K-FAC layers ({kinds['Conv2d']} Conv2d, {kinds['Linear']} Linear), "
              f"{parameters} parameters; dkfac plan {len(got)} layers, {plan['parameters']} parameters: "
              f"{'identical' if ok else 'MISMATCH'}")
        for e, g in mismatches[:10]:
            print(f"  torchvision {e} vs dkfac {g}")
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
