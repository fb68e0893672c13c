"""Where a step of stacked layers spends its time on the CPU, against layer by layer (stack_layers=False).

A resnet20-shaped stack of 3x3 convolutions (widths 16, 32, 64; 19 convolutions and a Linear head, no biases),
batch 32 of 32x32 images, intervals of 10^6 (no factor or second-order update: the step preconditions and writes
the gradients). The two preconditioners run in lockstep in one process, alternating which goes first, and each
step's `precondition` and `apply` phase times are taken (median and p90). Then `--profiled` steps of each run under
torch's profiler, and the ops' self time per step is summed: what the ops cost, against the phases' wall time. The
floor: the preconditioning products' FLOPs (eigen: 4 g a (g + a) a layer, inverse: 2 g a (g + a); unpadded) at this
machine's float32 GEMM rate, measured in the same run (the median of 7 products of 1024^3 at these threads).

  PYTHONPATH=build/python .venv/bin/python bench/stack_overhead.py [--steps 60] [--profiled 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict

import torch

import dkfac


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, 16, 3, padding=1, bias=False)]
    channels = 16
    for width in (16, 32, 64):
        for i in range(6):
            stride = 2 if i == 0 and width != 16 else 1
            layers += [torch.nn.Conv2d(channels, width, 3, padding=1, bias=False, stride=stride), torch.nn.ReLU()]
            channels = width
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--warmup', type=int, default=5)
    parser.add_argument('--profiled', type=int, default=20)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--method', choices=['eigen', 'inverse'], default='eigen')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f'machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; threads {args.threads}; '
          f'torch {torch.__version__}; dkfac {dkfac.__version__}; method {args.method}; load average '
          f'{os.getloadavg()[0]:.2f}')
    runs = {}
    for stacked in (True, False):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=10**6, inv_update_steps=10**6,
                                                  stack_layers=stacked, compute_method=args.method)
        runs[stacked] = (model, optimizer, preconditioner)
    layers = [m for m in runs[True][0].modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    shapes = [(m.weight.shape[0], m.weight[0].numel() + (m.bias is not None)) for m in layers]  # (g, a)
    flops = sum((4 if args.method == 'eigen' else 2) * g * a * (g + a) for g, a in shapes)
    left, right = torch.randn(1024, 1024), torch.randn(1024, 1024)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        torch.mm(left, right)
        times.append(time.perf_counter() - start)
    rate = 2 * 1024**3 / statistics.median(times[1:])
    print(f'floor: {flops / 1e6:.1f} MFLOP of products a step at {rate / 1e9:.1f} GFLOP/s (float32 GEMM, 1024^3) = '
          f'{1e3 * flops / rate:.2f} ms')
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (32,), generator=generator)

    def step(stacked: bool) -> None:
        model, optimizer, preconditioner = runs[stacked]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()

    phases: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(args.warmup + args.steps):
        for stacked in ((True, False) if i % 2 else (False, True)):
            step(stacked)
            if i >= args.warmup:
                times = runs[stacked][2].phase_times()
                phases[stacked].append((1e3 * times['precondition'], 1e3 * times['apply']))
    for stacked in (True, False):
        pre = [p for p, _ in phases[stacked]]
        both = [p + a for p, a in phases[stacked]]
        print(f"{'stacked' if stacked else 'layer by layer':>15}: precondition median {statistics.median(pre):.2f} "
              f'(p90 {percentile(pre, 0.9):.2f}) ms, precondition + apply median {statistics.median(both):.2f} '
              f'(p90 {percentile(both, 0.9):.2f}) ms')
    for stacked in (True, False):
        model, optimizer, preconditioner = runs[stacked]
        self_us: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for _ in range(args.profiled):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            with torch.autograd.profiler.profile() as profile:
                preconditioner.step()
            for event in profile.key_averages():
                self_us[event.key] += event.self_cpu_time_total
                calls[event.key] += event.count
            optimizer.step()
        per_step = {k: v / args.profiled / 1e3 for k, v in self_us.items()}
        top = sorted(per_step.items(), key=lambda kv: -kv[1])[:4]
        print(f"{'stacked' if stacked else 'layer by layer':>15}: ops' self time {sum(per_step.values()):.2f} ms a "
              f'step in {sum(calls.values()) / args.profiled:.0f} ops (profiled): '
              + ', '.join(f'{k} {v:.2f} ms x {calls[k] / args.profiled:.0f}' for k, v in top))


if __name__ == '__main__':
    main()
