#!/usr/bin/env python3
"""The second-order phase with ``second_order_concurrency=0`` (as many layers at once as torch's intra-op threads,
each on one thread) against ``1`` (one layer at a time on every thread), on bench/python_step.py's BERT-shaped stack
and ResNet, two preconditioners stepping alternately on the same batches at (1, 1); the phase's median per inverse
step over 8 steps each, after 2 untimed.

    PYTHONPATH=build/python .venv/bin/python bench/second_order_concurrency.py
"""
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import python_step as ps  # noqa: E402
torch.set_num_threads(2)
BERT = ['--bert-layers', '4', '--bert-hidden', '512', '--bert-heads', '8', '--bert-ffn', '2048', '--seq-len', '64',
        '--batch-size', '8', '--data', 'random']
for model, extra_args in (('bert', BERT),
                          ('resnet', ['--batch-size', '128', '--data', 'random'])):
    args = ps.parse_args(['--models', model, '--threads', '2'] + extra_args)
    backends = ps.import_backends(args)
    batches = ps.make_batches(args, model)[0]
    runners = {c: ps.Runner('dkfac', model, (1, 1), args, batches, backends, {'second_order_concurrency': c})
               for c in (0, 1)}
    times = {0: [], 1: []}
    for r in runners.values():
        for _ in range(2):
            r.step(None)
    for rep in range(8):
        for c in ((0, 1) if rep % 2 == 0 else (1, 0)):
            r = runners[c]
            before = r.preconditioner.phase_times(total=True)['second_order']
            r.step(None)
            times[c].append(1000 * (r.preconditioner.phase_times(total=True)['second_order'] - before))
    med = {c: statistics.median(v) for c, v in times.items()}
    print(f'{model}: second-order phase per inverse step, median of 8 (min, max): concurrent '
          f'{med[0]:.1f} ms ({min(times[0]):.1f}, {max(times[0]):.1f}), one at a time {med[1]:.1f} ms '
          f'({min(times[1]):.1f}, {max(times[1]):.1f}): {med[1] / med[0]:.2f}x')
print(platform.processor() or platform.machine(), torch.__version__, 'threads', torch.get_num_threads())
