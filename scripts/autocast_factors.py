#!/usr/bin/env python3
"""How far torch.autocast moves a K-FAC factor (docs/PRECISION.md): one step of a small conv net with and without
torch.autocast('cpu', bfloat16), same weights and batch, and the first convolution's A factor compared, for
kfac_pytorch v0.4.2 and for dkfac.

  PYTHONPATH=build/python .venv/bin/python scripts/autocast_factors.py --kfac-pytorch-src .gpu-bundle/kfac-pytorch
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 16 * 16, 10))


def first_a_factor(make, read, autocast: bool) -> torch.Tensor:
    model = net()
    preconditioner = make(model)
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.autocast('cpu', dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        out = model(x)
    out.float().pow(2).mean().backward()
    preconditioner.step()
    return read(preconditioner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--kfac-pytorch-src', help="kfac_pytorch v0.4.2's source tree (the folder holding kfac/)")
    args = parser.parse_args()
    import dkfac
    methods = {'dkfac': (lambda m: dkfac.KFACPreconditioner(m, factor_update_steps=1, inv_update_steps=1),
                         lambda p: p.state_dict()['layers']['0']['A'])}
    if args.kfac_pytorch_src:
        sys.path.insert(0, args.kfac_pytorch_src)
        import kfac
        methods['kfac_pytorch ' + kfac.__version__] = (
            lambda m: kfac.preconditioner.KFACPreconditioner(m, factor_update_steps=1, inv_update_steps=1),
            lambda p: next(layer for name, layer in p._layers.values() if name == '0').a_factor)
    for name, (make, read) in methods.items():
        with_autocast = first_a_factor(make, read, True)
        without = first_a_factor(make, read, False)
        difference = (with_autocast.double() - without.double())
        print(f'{name}: A of the first convolution under bfloat16 autocast is {with_autocast.dtype}; '
              f'max |difference| {difference.abs().max().item():.3e}, '
              f'relative (Frobenius) {(difference.norm() / without.double().norm()).item():.3e}')


if __name__ == '__main__':
    main()
