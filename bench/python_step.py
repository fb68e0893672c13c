#!/usr/bin/env python3
"""Python training-step benchmark: plain SGD vs dkfac vs kfac_pytorch, same models, data and threads.

One process, no torch.distributed. For each model ("cnn": the C++ tools' cnn; "resnet": the adapted
ResNet of examples/fmnist_models.py) and each (factor, inverse) interval, it builds a fresh model (same
seed) per method, each with its own SGD optimizer and, for dkfac and kfac_pytorch, a KFACPreconditioner
with the same settings (eigen, damping, lr, kl_clip, factor_decay, float32 inverses), then times the
whole training step ``zero_grad; forward; loss; backward; [preconditioner.step()]; optimizer.step()``
on the same sequence of batch-128 Fashion-MNIST batches:

* after a few warm-up steps, windows of N whole inverse periods (so every window holds the same number
  of inverse and factor steps), several repeats; the methods' windows are interleaved (plain, dkfac,
  kfac_pytorch, the order rotating per repeat) so that a change in machine load hits all of them;
* step time = window time / window steps (amortised over the inverse periods): median and p90 over the
  repeats, and the per-step median and p90 over all measured steps;
* the K-FAC overhead = K-FAC step - plain step (amortised medians, plain measured alongside), and
  dkfac's overhead / kfac_pytorch's;
* per-step splits for every method (forward+backward, preconditioner.step(), optimizer), and dkfac's
  per-phase times from ``phase_times()`` (mean per step, median, p90).

    python bench/python_step.py --kfac-pytorch-src /path/to/kfac_pytorch   # full, ~8 min on 2 cores
    python bench/python_step.py --quick                                  # ~40 s (~80 s with kfac_pytorch)
    python bench/python_step.py --quick --configure-allocator            # dkfac.configure_allocator() first
    python bench/python_step.py --models cnn --intervals 1,10 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'examples'))
import fmnist_models  # noqa: E402

METHODS = ('sgd', 'dkfac', 'kfac_pytorch')
DKFAC_PHASES = ('factors', 'second_order', 'precondition', 'apply', 'communication')
SPLITS = ('forward_backward', 'kfac_step', 'optimizer')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', default='cnn,resnet', help='comma-separated: cnn, resnet')
    parser.add_argument('--depth', type=int, default=14, help='ResNet depth (6n + 2)')
    parser.add_argument('--width', type=int, default=16, help='ResNet first-stage width')
    parser.add_argument('--intervals', default='1,10;10,100',
                        help="'factor,inverse' pairs separated by ';' (inverse a multiple of factor)")
    parser.add_argument('--batch-size', type=int, default=128)
    parser.add_argument('--threads', type=int, default=os.cpu_count() or 1, help='torch.set_num_threads')
    parser.add_argument('--configure-allocator', action='store_true',
                        help='call dkfac.configure_allocator() first (as the dkfac command line does)')
    parser.add_argument('--repeats', type=int, default=3, help='measured windows per method and interval')
    parser.add_argument('--min-window-steps', type=int, default=30,
                        help='a window is the fewest whole inverse periods with at least this many steps')
    parser.add_argument('--plain-steps', type=int, default=30,
                        help='steps per plain-SGD window (its steps are all alike)')
    parser.add_argument('--warmup', type=int, default=3, help='steps before the first window, per method')
    parser.add_argument('--damping', type=float, default=0.003)
    parser.add_argument('--lr', type=float, default=0.1, help='SGD lr, also the lr K-FAC uses for KL clipping')
    parser.add_argument('--kl-clip', type=float, default=0.001)
    parser.add_argument('--factor-decay', type=float, default=0.95)
    parser.add_argument('--data', choices=['real', 'random'], default='real',
                        help='Fashion-MNIST batches (random when its files are absent) or random ones')
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist')
    parser.add_argument('--batches', type=int, default=16, help='distinct batches, cycled')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--kfac-pytorch-src', default=None,
                        help="directory holding kfac_pytorch's 'kfac' package; without it kfac_pytorch is not run")
    parser.add_argument('--no-dkfac', action='store_true', help='leave dkfac out')
    parser.add_argument('--quick', action='store_true',
                        help='one repeat of one inverse period, 10 plain steps, 2 warm-up steps (~1 min)')
    parser.add_argument('--json', default=None, help='also write the results to this JSON file')
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.min_window_steps, args.plain_steps, args.warmup = 1, 1, 10, 2
    args.models = [m.strip() for m in args.models.split(',') if m.strip()]
    intervals = []
    for pair in args.intervals.split(';'):
        f, i = (int(v) for v in pair.split(','))
        if f <= 0 or i <= 0 or i % f:
            parser.error(f'interval {pair}: inverse steps must be a positive multiple of the factor steps')
        intervals.append((f, i))
    args.intervals = intervals
    return args


# --- environment ----------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown'


def load_average() -> str:
    try:
        return ' '.join(f'{v:.2f}' for v in os.getloadavg())
    except OSError:
        return 'unknown'


# --- data and methods -------------------------------------------------------------------------------------
def make_batches(args: argparse.Namespace) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    generator = torch.Generator().manual_seed(args.seed)
    if args.data == 'real':
        try:
            from fashion_mnist_resnet import load_split, normalise
            images, labels = load_split(args.data_dir, 'train')
            order = torch.randperm(len(labels), generator=generator)[:args.batches * args.batch_size]
            batches = [(normalise(images[idx]), labels[idx]) for idx in order.split(args.batch_size)]
            return batches, f'Fashion-MNIST train, {len(batches)} batches of {args.batch_size}, cycled'
        except FileNotFoundError as error:
            print(f'note: {error}; using random data', file=sys.stderr)
    batches = [(torch.randn(args.batch_size, 1, 28, 28, generator=generator),
                torch.randint(0, 10, (args.batch_size,), generator=generator)) for _ in range(args.batches)]
    return batches, f'random N(0,1) 1x28x28, {len(batches)} batches of {args.batch_size}, cycled'


def import_backends(args: argparse.Namespace) -> dict[str, Any]:
    backends: dict[str, Any] = {}
    if not args.no_dkfac:
        try:
            import dkfac
        except ImportError:
            sys.path.insert(0, str(REPO / 'build' / 'python'))
            import dkfac
        backends['dkfac'] = dkfac
    if args.kfac_pytorch_src:
        sys.path.insert(0, os.path.abspath(args.kfac_pytorch_src))
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', message='NVIDIA Apex is not installed')
            import kfac
        backends['kfac_pytorch'] = kfac
    return backends


class Runner:
    """One method's model, optimizer and preconditioner, stepping through the shared batches."""

    def __init__(self, method: str, model_name: str, interval: tuple[int, int] | None, args: argparse.Namespace,
                 batches: list, backends: dict[str, Any]) -> None:
        self.method, self.batches, self.index = method, batches, 0
        torch.manual_seed(args.seed)
        self.model = fmnist_models.get_model(model_name, args.depth, args.width)
        self.model.train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        self.preconditioner = None
        if method != 'sgd':
            kfac = backends[method]
            options = dict(factor_update_steps=interval[0], inv_update_steps=interval[1], damping=args.damping,
                           factor_decay=args.factor_decay, kl_clip=args.kl_clip, lr=args.lr,
                           compute_method=kfac.enums.ComputeMethod.EIGEN, inv_dtype=torch.float32)
            self.preconditioner = kfac.preconditioner.KFACPreconditioner(self.model, **options)
        self.has_phases = hasattr(self.preconditioner, 'phase_times')
        self.loss = math.nan

    def step(self, record: dict[str, list[float]] | None) -> None:
        data, target = self.batches[self.index % len(self.batches)]
        self.index += 1
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(data), target)
        loss.backward()
        t1 = time.perf_counter()
        if self.preconditioner is not None:
            self.preconditioner.step()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.loss = float(loss)
        if record is not None:
            record['step'].append(t3 - t0)
            record['forward_backward'].append(t1 - t0)
            record['kfac_step'].append(t2 - t1)
            record['optimizer'].append(t3 - t2)
            if self.has_phases:
                for phase, seconds in self.preconditioner.phase_times().items():
                    record.setdefault(phase, []).append(seconds)

    def window(self, steps: int, record: dict[str, list[float]]) -> float:
        """Runs `steps` steps; returns the wall time per step."""
        gc.collect()
        start = time.perf_counter()
        for _ in range(steps):
            self.step(record)
        return (time.perf_counter() - start) / steps


# --- statistics and output --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float]:
    """mean, median and p90 in milliseconds."""
    if not values:
        return {'mean': math.nan, 'median': math.nan, 'p90': math.nan}
    return {'mean': 1000 * statistics.fmean(values), 'median': 1000 * statistics.median(values),
            'p90': 1000 * percentile(values, 90)}


def fmt(value: float, width: int = 7) -> str:
    if value is None or math.isnan(value):
        return '-'.rjust(width)
    return (f'{value:.1f}' if abs(value) >= 10 else f'{value:.2f}').rjust(width)


def triple(s: dict[str, float]) -> str:
    return f"{fmt(s['mean'], 6)} /{fmt(s['median'], 6)} /{fmt(s['p90'], 6)}"


def measure(model_name: str, interval: tuple[int, int], methods: list[str], plain: Runner,
            args: argparse.Namespace, batches: list, backends: dict[str, Any], log) -> dict[str, Any]:
    periods = max(1, math.ceil(args.min_window_steps / interval[1]))
    steps = periods * interval[1]
    runners = {'sgd': plain}
    for method in methods:
        if method == 'sgd':
            continue
        runners[method] = Runner(method, model_name, interval, args, batches, backends)
        for _ in range(args.warmup):
            runners[method].step(None)
    records = {m: {k: [] for k in ('step',) + SPLITS} for m in runners}
    windows: dict[str, list[float]] = {m: [] for m in runners}
    order = list(runners)
    for repeat in range(args.repeats):
        rotated = order[repeat % len(order):] + order[:repeat % len(order)]
        for method in rotated:
            n = min(steps, args.plain_steps) if method == 'sgd' else steps
            windows[method].append(runners[method].window(n, records[method]))
        log(f'  {model_name} ({interval[0]},{interval[1]}) repeat {repeat + 1}/{args.repeats}: ' + ', '.join(
            f'{m} {1000 * windows[m][-1]:.1f} ms' for m in order) + f'  [load {load_average()}]')
    result: dict[str, Any] = {'model': model_name, 'factor_update_steps': interval[0],
                              'inv_update_steps': interval[1], 'window_steps': steps,
                              'plain_window_steps': min(steps, args.plain_steps), 'methods': {}}
    for method, runner in runners.items():
        rec = records[method]
        entry = {
            'amortised_ms': {'median': 1000 * statistics.median(windows[method]),
                             'p90': 1000 * percentile(windows[method], 90),
                             'windows': [1000 * w for w in windows[method]]},
            'per_step_ms': summary(rec['step']),
            'splits_ms': {k: summary(rec[k]) for k in SPLITS},
            'measured_steps': len(rec['step']),
            'final_loss': runner.loss,
        }
        if method != 'sgd' and runner.has_phases:
            entry['phases_ms'] = {p: summary(rec.get(p, [])) for p in DKFAC_PHASES}
        result['methods'][method] = entry
    base = result['methods']['sgd']['amortised_ms']['median']
    for method, entry in result['methods'].items():
        entry['overhead_ms'] = entry['amortised_ms']['median'] - base
        entry['x_sgd'] = entry['amortised_ms']['median'] / base
    if 'dkfac' in runners and 'kfac_pytorch' in runners:
        theirs = result['methods']['kfac_pytorch']['overhead_ms']
        result['overhead_ratio_dkfac_to_kfac_pytorch'] = (result['methods']['dkfac']['overhead_ms'] / theirs
                                                           if theirs > 0 else math.nan)
    return result


def report(results: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    lines.append('python_step: ' + json.dumps(env, sort_keys=True))
    cond = (f"batch {args.batch_size}, {env['torch_threads']} torch threads (BLAS: {env['blas']}), allocator: "
            f"{env['allocator']}")
    lines.append('')
    lines.append('Step time, ms. amortised = window time / window steps over whole inverse periods: median / p90 '
                 f'over {args.repeats} repeats; per step = mean / median / p90 over all measured steps.')
    lines.append(f'Conditions on every row: {cond}; {env["data"]}; eigen, damping {args.damping}, lr {args.lr}, '
                 f'kl_clip {args.kl_clip}, factor_decay {args.factor_decay}, float32 inverses; one process.')
    head = (f"{'model':<10}{'(f,inv)':<9}{'method':<14}{'window':>9}{'amortised med/p90':>20}"
            f"{'per step mean/med/p90':>26}{'fwd+bwd med':>12}{'kfac.step mean':>15}{'overhead':>10}{'x SGD':>7}"
            f"{'loss':>8}")
    lines.append(head)
    for r in results:
        for method, e in r['methods'].items():
            window = f"{e['measured_steps'] // args.repeats}x{args.repeats}"
            lines.append(
                f"{r['model']:<10}{'(%d,%d)' % (r['factor_update_steps'], r['inv_update_steps']):<9}{method:<14}"
                f"{window:>9}{fmt(e['amortised_ms']['median'], 9)} /{fmt(e['amortised_ms']['p90'], 8)}"
                f"   {triple(e['per_step_ms'])}{fmt(e['splits_ms']['forward_backward']['median'], 12)}"
                f"{fmt(e['splits_ms']['kfac_step']['mean'], 15)}{fmt(e['overhead_ms'], 10)}{e['x_sgd']:7.2f}"
                f"{e['final_loss']:8.4f}")
    lines.append('')
    lines.append("dkfac phases (phase_times()), ms per step: mean (amortised) / median / p90 over the measured steps")
    lines.append(f"{'model':<10}{'(f,inv)':<9}" + ''.join(f'{p:>24}' for p in DKFAC_PHASES))
    for r in results:
        e = r['methods'].get('dkfac')
        if e and 'phases_ms' in e:
            lines.append(f"{r['model']:<10}{'(%d,%d)' % (r['factor_update_steps'], r['inv_update_steps']):<9}"
                         + ''.join(f'{triple(e["phases_ms"][p]):>24}' for p in DKFAC_PHASES))
    lines.append('')
    lines.append('Per-step splits, ms: mean (amortised) / median / p90 over the measured steps '
                 '(kfac_pytorch builds its factors in the forward/backward hooks, dkfac in step())')
    lines.append(f"{'model':<10}{'(f,inv)':<9}{'method':<14}" + ''.join(f'{s:>24}' for s in SPLITS))
    for r in results:
        for method, e in r['methods'].items():
            lines.append(f"{r['model']:<10}{'(%d,%d)' % (r['factor_update_steps'], r['inv_update_steps']):<9}"
                         f"{method:<14}" + ''.join(f'{triple(e["splits_ms"][s]):>24}' for s in SPLITS))
    ratios = [r for r in results if 'overhead_ratio_dkfac_to_kfac_pytorch' in r]
    if ratios:
        lines.append('')
        lines.append('K-FAC overhead (amortised step - plain SGD step, medians), ms, and dkfac / kfac_pytorch:')
        for r in ratios:
            d, k = r['methods']['dkfac']['overhead_ms'], r['methods']['kfac_pytorch']['overhead_ms']
            ratio = r['overhead_ratio_dkfac_to_kfac_pytorch']
            verdict = 'yes' if ratio <= 0.5 else 'no'
            lines.append(f"  {r['model']:<8} ({r['factor_update_steps']},{r['inv_update_steps']}) [{cond}]: dkfac "
                         f"{d:.1f} ms, kfac_pytorch {k:.1f} ms, ratio {ratio:.2f}; at most half: {verdict}")
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = import_backends(args)
    allocator = 'glibc defaults'
    if args.configure_allocator:
        allocator = backends['dkfac'].configure_allocator() if 'dkfac' in backends else 'dkfac not loaded'
    batches, data = make_batches(args)
    methods = ['sgd'] + [m for m in METHODS[1:] if m in backends]
    env = {
        'cpu': cpu_model(), 'cores': os.cpu_count(), 'affinity': len(os.sched_getaffinity(0)),
        'torch': torch.__version__, 'torch_threads': torch.get_num_threads(),
        'interop_threads': torch.get_num_interop_threads(),
        'blas': 'MKL' if torch.backends.mkl.is_available() else 'not MKL', 'allocator': allocator,
        'python': platform.python_version(), 'dkfac': getattr(backends.get('dkfac'), '__version__', None),
        'kfac_pytorch': getattr(backends.get('kfac_pytorch'), '__version__', None),
        'kfac_pytorch_src': os.path.abspath(args.kfac_pytorch_src) if args.kfac_pytorch_src else None,
        'batch_size': args.batch_size, 'data': data, 'models': args.models,
        'resnet': f'resnet{args.depth} width {args.width}', 'seed': args.seed, 'repeats': args.repeats,
        'warmup': args.warmup, 'quick': args.quick, 'load_average_start': load_average(),
    }

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    log(f"python_step: {env['cpu']}, {env['cores']} cores, torch {env['torch']} with {env['torch_threads']} threads, "
        f"BLAS {env['blas']}, allocator {allocator}, dkfac {env['dkfac']}, kfac_pytorch {env['kfac_pytorch']}; methods {methods}")
    started = time.perf_counter()
    results = []
    for model_name in args.models:
        plain = Runner('sgd', model_name, None, args, batches, backends)
        for _ in range(args.warmup):
            plain.step(None)
        for interval in args.intervals:
            results.append(measure(model_name, interval, methods, plain, args, batches, backends, log))
    env['load_average_end'] = load_average()
    env['wall_s'] = round(time.perf_counter() - started, 1)
    text = report(results, env, args)
    print(text)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'environment': env, 'results': results}, f, indent=1, sort_keys=True)
        print(f'\npython_step: {args.json}')


if __name__ == '__main__':
    main()
