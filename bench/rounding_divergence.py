#!/usr/bin/env python3
"""Where two dkfac runs that differ only by rounding part: ``stack_layers`` on and off (docs/MATH.md section 2.9) on
bench/python_step.py's ResNet, the same batches, (10, 100) intervals, stepping in lockstep. Prints, from the first step
whose parameters differ, each step's two losses and the relative difference of all parameters (0 while the runs are
equal bit for bit), so that a benchmark's final losses can be read against it.

    PYTHONPATH=build/python .venv/bin/python bench/rounding_divergence.py [--steps 42]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import python_step as ps  # noqa: E402


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--steps', type=int, default=42)
    steps = parser.parse_args().steps
    args = ps.parse_args(['--models', 'resnet'])
    backends = ps.import_backends(args)
    batches = ps.make_batches(args, 'resnet')[0]
    runners = {name: ps.Runner('dkfac', 'resnet', (10, 100), args, batches, backends, extra)
               for name, extra in (('stacked', {}), ('layer_by_layer', {'stack_layers': False}))}
    parted = False
    for step in range(steps):
        for runner in runners.values():
            runner.step(None)
        a, b = (flat(r.model) for r in runners.values())
        difference = ((a - b).norm() / b.norm()).item()
        parted = parted or difference > 0
        if parted:
            losses = ' '.join(f'{r.loss:.7f}' for r in runners.values())
            print(f'step {step}: losses (stacked, layer by layer) {losses}; relative parameter difference '
                  f'{difference:.2e}')
    if not parted:
        print(f'equal bit for bit over {steps} steps')


if __name__ == '__main__':
    main()
