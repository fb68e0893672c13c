#!/usr/bin/env python3
"""The error of each fast mode against the exact mode: one preconditioned gradient, and the loss after training.

Issue 44's fast modes trade exactness for speed; each is reported with two errors, measured here:

* **the preconditioned gradient**: two copies of a bench/python_step.py model (same seed) each get a
  preconditioner, exact and fast; both see the same batches for ``--state-steps`` steps at factor and inverse
  interval 1 without any optimizer step (the parameters stay equal, so both build the same factors, and the same
  decompositions in float32, stored in the mode's dtype: bfloat16's round them), then one more batch: the relative error
  ||V_fast - V_exact|| / ||V_exact|| of each layer's preconditioned gradient (weight and bias), its median and
  largest over the layers, and over the whole model;
* **the loss after training**: the exact and the fast mode each train a fresh copy (same seed, same batches, SGD
  with momentum as the benchmark's, intervals ``--intervals``) for ``--train-steps`` steps; reported: the mean
  loss of the last 10 steps of each and the fast mode's relative difference (goal: within 1%).

A mode is NAME:KEY=VALUE[,KEY=VALUE] (bench/step_kinds.py's --variant), e.g. tf32:precondition_dtype=tf32 or
bf16:inv_dtype=bfloat16. The models, data and settings are bench/python_step.py's (its flags pass through).

    python bench/fast_mode_error.py --device cuda --models bert --bert-layers 4 --mode tf32:precondition_dtype=tf32 \\
        --mode bf16:inv_dtype=bfloat16 --json fast.json
    python bench/fast_mode_error.py --quick --models bert --mode bf16:inv_dtype=bfloat16     # CPU, the code paths
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import python_step as ps  # noqa: E402
import step_kinds  # noqa: E402  (the --variant syntax)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--mode', action='append', default=[], metavar='NAME:KEY=VALUE[,KEY=VALUE]', required=True)
    parser.add_argument('--state-steps', type=int, default=3)
    parser.add_argument('--train-steps', type=int, default=300)
    parser.add_argument('--train-intervals', default='10,100', help='factor,inverse for the training comparison')
    ours, rest = parser.parse_known_args(argv)
    args = step_kinds.parse_args(rest + sum((['--variant', m] for m in ours.mode), []))
    args.state_steps, args.train_steps = ours.state_steps, ours.train_steps
    f, i = (int(v) for v in ours.train_intervals.split(','))
    args.train_interval = (f, i)
    return args


def runner(args: argparse.Namespace, model_name: str, batches: list, backends: dict[str, Any],
           interval: tuple[int, int], options: dict[str, Any] | None) -> ps.Runner:
    return ps.Runner('dkfac', model_name, interval, args, batches, backends, options)


def gradient_error(args: argparse.Namespace, model_name: str, batches: list, backends: dict[str, Any],
                   options: dict[str, Any]) -> dict[str, Any]:
    exact = runner(args, model_name, batches, backends, (1, 1), None)
    fast = runner(args, model_name, batches, backends, (1, 1), options)
    layers = [(n, m) for n, m in exact.model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    fast_modules = dict(fast.model.named_modules())

    def backward(r: ps.Runner, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        data, target = batch
        r.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(r.model(data).flatten(0, -2), target.flatten()).backward()

    for step in range(args.state_steps + 1):
        batch = batches[step % len(batches)]
        for r in (exact, fast):
            backward(r, batch)
            r.preconditioner.step()  # no optimizer step: both keep the same parameters
    errors, total_diff, total_norm = [], 0.0, 0.0
    for name, module in layers:
        other = fast_modules[name]
        v = torch.cat([p.grad.flatten().double() for p in module.parameters()])
        w = torch.cat([p.grad.flatten().double() for p in other.parameters()])
        diff, norm = float((w - v).norm()), float(v.norm())
        errors.append(diff / norm if norm > 0 else 0.0)
        total_diff += diff**2
        total_norm += norm**2
    del exact, fast
    ps.release()
    return {'layers': len(errors), 'median': statistics.median(errors), 'max': max(errors),
            'model': (total_diff / total_norm) ** 0.5}


def trained_loss(args: argparse.Namespace, model_name: str, batches: list, backends: dict[str, Any],
                 options: dict[str, Any] | None) -> dict[str, Any]:
    r = runner(args, model_name, batches, backends, args.train_interval, options)
    losses = []
    start = time.perf_counter()
    for _ in range(args.train_steps):
        r.step(None)
        losses.append(r.last_loss)
    losses = [float(x) for x in losses]  # read once, at the end: no synchronisation per step
    seconds = time.perf_counter() - start
    del r
    ps.release()
    return {'last10_mean': statistics.fmean(losses[-10:]), 'first': losses[0], 'seconds': seconds}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backends = step_kinds.prepare(args)
    results: dict[str, Any] = {'environment': {
        'torch': torch.__version__, 'device': args.device,
        'gpu': ps.cuda_environment() if args.device == 'cuda' else None, 'cpu': ps.cpu_model(),
        'modes': {n: {k: str(v) for k, v in o.items()} for n, o in args.variants.items()},
        'state_steps': args.state_steps, 'train_steps': args.train_steps, 'train_interval': list(args.train_interval),
        'models': {m: ps.describe_model(m, args) for m in args.models}, 'seed': args.seed}, 'models': {}}

    def save() -> None:
        if args.json:
            ps.dump_json(args.json, results)

    for model_name in args.models:
        batches, _ = ps.make_batches(args, model_name)
        out: dict[str, Any] = results['models'].setdefault(model_name, {})
        for name, options in args.variants.items():
            out.setdefault(name, {})['gradient_error'] = gradient_error(args, model_name, batches, backends, options)
            e = out[name]['gradient_error']
            print(f"{model_name} {name}: preconditioned gradient relative error over {e['layers']} layers: median "
                  f"{e['median']:.2e}, max {e['max']:.2e}, whole model {e['model']:.2e}", flush=True)
            save()
        if args.train_steps > 0:
            exact = trained_loss(args, model_name, batches, backends, None)
            out['exact'] = {'trained': exact}
            print(f"{model_name} exact: loss {exact['first']:.4f} -> {exact['last10_mean']:.4f} (mean of the last 10 of "
                  f"{args.train_steps} steps at {args.train_interval}), {exact['seconds']:.1f} s", flush=True)
            save()
            for name, options in args.variants.items():
                fast = trained_loss(args, model_name, batches, backends, options)
                fast['relative_to_exact'] = (fast['last10_mean'] - exact['last10_mean']) / exact['last10_mean']
                out[name]['trained'] = fast
                print(f"{model_name} {name}: loss {fast['first']:.4f} -> {fast['last10_mean']:.4f}, "
                      f"{100 * fast['relative_to_exact']:+.2f}% from exact (goal within 1%), {fast['seconds']:.1f} s",
                      flush=True)
                save()


if __name__ == '__main__':
    main()
