#!/usr/bin/env python3
"""Writes tests/python/data/kfac_pytorch_golden.pt from a kfac_pytorch v0.4.2 source tree.

Usage: PYTHONPATH=<kfac-pytorch source> /usr/bin/python3 tests/python/make_golden.py
(the tree's kfac/__init__.py reads its version from an installed distribution: replace that line
with __version__ = '0.4.2' when running from a source tree). The tests compare dkfac against the
file, so CI needs no kfac_pytorch.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scenarios  # noqa: E402

import kfac  # noqa: E402


def main() -> None:
    golden = {'kfac_version': kfac.__version__, 'torch_version': torch.__version__, 'scenarios': {}}
    for name in scenarios.SCENARIOS:
        result = scenarios.run(kfac, name)
        golden['scenarios'][name] = {'grads': result['grads'], 'params': result['params']}
    # Migration: kfac_pytorch trains 3 steps; its state dict and parameters then continue in a fresh
    # preconditioner (second-order state recomputed from the loaded factors) for 3 more steps.
    first = scenarios.run(kfac, 'cnn_eigen', steps=3)
    model = first['model']
    state = first['state']
    params = [p.detach().clone() for p in model.parameters()]
    second = scenarios.run(kfac, 'cnn_eigen', steps=3, model=model, state=state, start=3)
    golden['migration'] = {'state': state, 'params': params, 'grads': second['grads']}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'kfac_pytorch_golden.pt')
    torch.save(golden, path)
    print(f'wrote {path}: {len(golden["scenarios"])} scenarios and a migration')


if __name__ == '__main__':
    main()
