#!/usr/bin/env python3
"""Training steps with ``second_order_lag`` k (docs/MATH.md section 2.8: each second-order update computed beside the
next k steps and installed at the k-th) against the exact mode, timed in lockstep.

bench/python_step.py's models, data and settings (its flags pass through). For each model, one runner per mode
(same seed, same batches) at (factor, inverse) intervals ``--intervals``; the runners take turns, one whole inverse
cycle (inverse-interval steps) each, in an order that alternates every cycle, so that load falls alike. A cycle's
time is wall time from its first step's start to its last step's end (on CUDA after a synchronisation at both ends,
so the side stream's work counts where it is not hidden); reported per mode: the median and p90 of the cycles'
time per step, the ratio to the exact mode's median, and the second-order phase per cycle (the exact mode's
decompositions; the lagged modes' waits for them). The loss is each runner's last; the modes train apart.

    PYTHONPATH=build/python .venv/bin/python bench/second_order_lag.py --models resnet --lag 1 --lag 5
    PYTHONPATH=build/python python bench/second_order_lag.py --device cuda --models bert --bert-layers 8 --lag 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import python_step as ps  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--lag', type=int, action='append', default=[], help='a lag to time (repeat the flag)')
    parser.add_argument('--intervals', default='1,10', help='factor,inverse')
    parser.add_argument('--cycles', type=int, default=8, help='timed inverse cycles per mode')
    parser.add_argument('--warmup-cycles', type=int, default=2)
    parser.add_argument('--json', help='write the figures here')
    ours, rest = parser.parse_known_args(argv)
    args = ps.parse_args(rest)
    for key in ('lag', 'cycles', 'warmup_cycles', 'json'):
        setattr(args, key, getattr(ours, key))
    args.lag = args.lag or [1]
    args.interval = tuple(int(v) for v in ours.intervals.split(','))
    return args


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def cycle(runner: ps.Runner, steps: int) -> tuple[float, float]:
    """Seconds of `steps` steps, wall time, and the second-order phase's seconds in them."""
    phases = runner.preconditioner.phase_times
    if runner.cuda:
        torch.cuda.synchronize()
    before = phases(total=True)['second_order']
    start = time.perf_counter()
    for _ in range(steps):
        runner.step(None)
    if runner.cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, phases(total=True)['second_order'] - before


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads) if args.threads else None
    backends = ps.import_backends(args)
    modes = {'exact': 0, **{f'lag {k}': k for k in args.lag}}
    steps = args.interval[1]
    env = {'cpu': ps.cpu_model(), 'device': args.device, 'torch': torch.__version__,
           'threads': torch.get_num_threads(), 'interval': list(args.interval), 'cycles': args.cycles,
           'load_average_start': ps.load_average()}
    if args.device == 'cuda':
        env['gpu'] = torch.cuda.get_device_name()
    print(json.dumps(env))
    figures = {'env': env, 'models': {}}
    for model in args.models:
        batches = ps.make_batches(args, model)[0]
        runners = {name: ps.Runner('dkfac', model, args.interval, args, batches, backends, {'second_order_lag': k})
                   for name, k in modes.items()}
        for runner in runners.values():  # the first update runs at once, and the first cycles warm up
            for _ in range(args.warmup_cycles):
                cycle(runner, steps)
        times = {name: [] for name in modes}
        second_order = {name: [] for name in modes}
        names = list(modes)
        for rep in range(args.cycles):
            for name in (names if rep % 2 == 0 else names[::-1]):
                seconds, phase = cycle(runners[name], steps)
                times[name].append(1000 * seconds / steps)
                second_order[name].append(1000 * phase)
        exact = statistics.median(times['exact'])
        rows = {}
        for name in modes:
            med = statistics.median(times[name])
            rows[name] = dict(step_ms_median=med, step_ms_p90=percentile(times[name], 0.9),
                              ratio_to_exact=med / exact,
                              second_order_ms_per_cycle=statistics.median(second_order[name]),
                              loss=runners[name].loss, step_ms=times[name])
            print(f'{model} {name:>7}: step {med:8.2f} ms median, {rows[name]["step_ms_p90"]:8.2f} p90 '
                  f'({med / exact:.3f}x exact); second-order phase {rows[name]["second_order_ms_per_cycle"]:8.2f} '
                  f'ms per {steps}-step cycle; last loss {runners[name].loss:.4f}')
        figures['models'][model] = rows
    figures['env']['load_average_end'] = ps.load_average()
    print('load average', figures['env']['load_average_start'], '->', figures['env']['load_average_end'])
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == '__main__':
    main()
