#!/usr/bin/env python3
"""The element-wise part of Adam in the K-FAC eigenbasis (docs/MATH.md section 8) on one layer: the moments' update,
the bias corrections and m-hat / (sqrt(v-hat) + eps) for P of shape [g, a], as dkfac runs it (torch's fused Adam
kernel, dkfac/math/eigen_adam.cpp) against the same arithmetic written as separate ATen operations (what the first
implementation ran). The two are timed alternately in one process, median and p90 of --repeats each.

    PYTHONPATH=build/python .venv/bin/python bench/eigen_adam_kernel.py [--g 1024 --a 257 --threads 1 --device cpu]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--g', type=int, default=1024)
    parser.add_argument('--a', type=int, default=257)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=100)
    parser.add_argument('--device', default='cpu')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    b1, b2, eps = 0.9, 0.999, 1e-8
    p = torch.randn(args.g, args.a, device=device)
    state = {name: [torch.zeros_like(p), torch.zeros_like(p)] for name in ('separate', 'fused')}
    steps = {'separate': torch.zeros(1, dtype=torch.float64, device=device),
             'fused': torch.zeros(1, device=device)}

    def separate() -> torch.Tensor:
        m, v = state['separate']
        finite = torch.isfinite(p).all()
        m2 = torch.where(finite, m * b1 + p * (1 - b1), m)
        v2 = torch.where(finite, v * b2 + p * p * (1 - b2), v)
        t = torch.where(finite, steps['separate'] + 1.0, steps['separate'])
        bc1, bc2 = 1.0 - torch.pow(b1, t), 1.0 - torch.pow(b2, t)
        scaled = (m2 / bc1.to(p.dtype)) / ((v2 / bc2.to(p.dtype)).sqrt_() + eps)
        scaled.masked_fill_(finite.logical_not(), float('nan'))
        state['separate'], steps['separate'] = [m2, v2], t
        return scaled

    def fused() -> torch.Tensor:
        m, v = state['fused']
        finite = torch.isfinite(p).all()
        scaled = p * 0.0
        steps['fused'].add_(finite)
        torch._fused_adam_([scaled], [p], [m], [v], [], [steps['fused']], lr=-1.0, beta1=b1, beta2=b2,
                           weight_decay=0.0, eps=eps, amsgrad=False, maximize=False, grad_scale=None,
                           found_inf=finite.logical_not().float())
        return scaled

    def sync() -> None:
        if device.type == 'cuda':
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {'separate': [], 'fused': []}
    for _ in range(args.repeats):
        for name, run in (('separate', separate), ('fused', fused)):
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - start)
    torch.testing.assert_close(separate(), fused(), rtol=1e-5, atol=1e-6)  # the same arithmetic
    print(f'machine: {platform.processor() or platform.machine()}, {args.threads} thread(s); device {device}; '
          f'torch {torch.__version__}; P [{args.g}, {args.a}] float32; {args.repeats} repeats each, alternating')
    for name, t in times.items():
        t = sorted(t)
        print(f'{name:9} median {1e3 * statistics.median(t):7.3f} ms  p90 {1e3 * t[int(0.9 * len(t))]:7.3f} ms')


if __name__ == '__main__':
    main()
