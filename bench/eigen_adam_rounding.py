#!/usr/bin/env python3
"""How much `eigen_adam`'s step moves when its inputs move by rounding alone, against K-FAC's eigen method.

One float64 Linear(16 -> 8) trained by dkfac.optim.KFAC (AdamW base, factor and inverse interval 1, float64
second-order state) on cross-entropy, twice: once on the batches as drawn, once on the same batches scaled by
1 + 1e-14 (what another summation order, another number of ranks or another strategy changes). Prints, for batches
narrower and wider than the layer, each step's relative difference of the parameters' change since the start,
||dp_1 - dp_2|| / ||dp_1||, and the eigenvalues of the first step's G factor.

K-FAC's step is a function of the factors, whatever basis an eigensolver picks within a repeated (or nearly repeated)
eigenvalue. eigen_adam's is not: Adam normalises each entry in the eigenbasis, and within an eigenvalue repeated to
rounding the basis is the solver's choice, which rounding moves. Early on, G is close to the identity its running
average starts from (a classifier's output gradients are small), so its eigenvalues agree to many digits.

    PYTHONPATH=build/python .venv/bin/python bench/eigen_adam_rounding.py
"""

from __future__ import annotations

import platform
import warnings

import torch

import dkfac

STEPS = 6


def run(eigen_adam: bool, scale: float, batch: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).double()
    opt = dkfac.optim.KFAC(model, torch.optim.AdamW(model.parameters(), lr=1e-3), eigen_adam=eigen_adam,
                           factor_update_steps=1, inv_update_steps=1, kl_clip=None if eigen_adam else 0.001,
                           inv_dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    flat = [torch.cat([p.detach().flatten() for p in model.parameters()]).clone()]
    g_eigenvalues = None
    for _ in range(STEPS):
        x = torch.randn(batch, 16, generator=generator, dtype=torch.float64) * scale
        y = torch.randint(8, (batch,), generator=generator)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if g_eigenvalues is None:
            g_eigenvalues = opt.preconditioner._core.layer_states()[0]['g_eigenvalues'].clone()
        flat.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
    return flat, g_eigenvalues


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter('ignore')
    print(f'machine: {platform.machine()} {platform.processor() or ""}, {torch.get_num_threads()} thread, '
          f'torch {torch.__version__}, dkfac {dkfac.__version__}, CPU float64')
    for batch in (4, 64):
        for eigen_adam in (True, False):
            a, eigenvalues = run(eigen_adam, 1.0, batch)
            b, _ = run(eigen_adam, 1.0 + 1e-14, batch)
            moved = [((x - y).norm() / (x - a[0]).norm()).item() for x, y in zip(a[1:], b[1:])]
            name = 'eigen_adam' if eigen_adam else 'eigen     '
            print(f'batch {batch:2d} {name}: relative difference of the change, steps 1-{STEPS}: '
                  + ' '.join(f'{m:.1e}' for m in moved))
        print(f'batch {batch:2d} the first step\'s G eigenvalues: '
              + ' '.join(f'{v:.9f}' for v in eigenvalues.tolist()))


if __name__ == '__main__':
    main()
