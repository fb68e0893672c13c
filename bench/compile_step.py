#!/usr/bin/env python3
"""torch.compile with and without dkfac: the training step of a compiled model against the eager one, in lockstep.

Four methods train their own copy of one model (same seed, same batches): eager SGD, compiled SGD, eager dkfac and
compiled dkfac (KFACPreconditioner(model), then torch.compile(model)). Each step runs every method once, in an order
that rotates from step to step, so that a slow spell of a shared machine falls on all of them; the whole step
``zero_grad; forward; loss; backward; [preconditioner.step()]; optimizer.step()`` is timed (on CUDA, up to a
synchronize). The first --warmup steps (compilation included) are not timed. It prints each method's median and
p90 per step, and the ratios compiled / eager, with the machine, device, threads and versions; --json writes it all.

The model is python_step.py's BERT-shaped encoder (explicit Linear projections), small by default so that the CPU
runs it in a minute: 2 layers of hidden 256, 4 heads, FFN 1024, sequence 64, batch 8.

  bench/compile_step.py [--device cuda] [--layers 2 --hidden 256 ...] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_step import BertEncoder, cpu_model, cuda_environment, dump_json, load_average, summary  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cpu')
    p.add_argument('--layers', type=int, default=2)
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--ffn', type=int, default=1024)
    p.add_argument('--seq-len', type=int, default=64)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--vocab', type=int, default=1000)
    p.add_argument('--factor-update-steps', type=int, default=1)
    p.add_argument('--inv-update-steps', type=int, default=10)
    p.add_argument('--steps', type=int, default=40, help='timed steps per method')
    p.add_argument('--warmup', type=int, default=3, help='untimed steps first (compilation happens here)')
    p.add_argument('--backend', default='inductor')
    p.add_argument('--threads', type=int, default=torch.get_num_threads())
    p.add_argument('--json', help='write the results here')
    return p.parse_args(argv)


class Method:
    def __init__(self, name: str, model: torch.nn.Module, *, compiled: bool, kfac: bool,
                 args: argparse.Namespace) -> None:
        import dkfac

        self.name, self.model = name, model
        self.preconditioner = (dkfac.KFACPreconditioner(model, factor_update_steps=args.factor_update_steps,
                                                        inv_update_steps=args.inv_update_steps) if kfac else None)
        self.run = torch.compile(model, backend=args.backend) if compiled else model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, cuda: bool, timed: bool) -> None:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        logits = self.run(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        if self.preconditioner is not None:
            self.preconditioner.step()
        self.optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if timed:
            self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # Two copies of one model class are compiled here, one hooked by dkfac, one not: Dynamo reuses a graph for
    # another instance whose guards pass, and by default it does not guard on module hooks, so the hooked copy
    # would run the graph traced without its hooks (K-FAC then refuses its first step: no capture ran).
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    device = torch.device(args.device)
    cuda = device.type == 'cuda'
    torch.manual_seed(0)
    base = BertEncoder(args.layers, args.hidden, args.heads, args.ffn, args.seq_len, args.vocab, 2).to(device)
    methods = [Method(name, copy.deepcopy(base), compiled=compiled, kfac=kfac, args=args)
               for name, compiled, kfac in (('eager sgd', False, False), ('compiled sgd', True, False),
                                            ('eager dkfac', False, True), ('compiled dkfac', True, True))]
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator).to(device),
                torch.randint(0, 2, (args.batch, args.seq_len), generator=generator).to(device)) for _ in range(8)]
    from torch._dynamo.utils import counters

    counters.clear()
    for step in range(args.warmup + args.steps):
        tokens, labels = batches[step % len(batches)]
        shift = step % len(methods)
        for method in methods[shift:] + methods[:shift]:
            method.step(tokens, labels, cuda, timed=step >= args.warmup)
        print(f'step {step}: ' + ', '.join(f'{m.name} {1000 * (m.seconds[-1] if m.seconds else 0):.1f} ms'
                                            for m in methods), file=sys.stderr, flush=True)
    import dkfac

    env: dict[str, Any] = {
        'machine': platform.node(), 'cpu': cpu_model(), 'threads': args.threads, 'load_average': load_average(),
        'python': platform.python_version(), 'torch': torch.__version__, 'dkfac': dkfac.__version__,
        'device': str(device), 'backend': args.backend,
        'graphs': dict(counters['stats']), 'graph_breaks': sum(counters['graph_break'].values()),
    }
    if cuda:
        env.update(cuda_environment())
    results = {m.name: {**summary(m.seconds), 'steps': len(m.seconds), 'last_loss': m.losses[-1]} for m in methods}
    by = {m.name: results[m.name]['median'] for m in methods}
    ratios = {
        'compiled / eager, sgd': by['compiled sgd'] / by['eager sgd'],
        'compiled / eager, dkfac': by['compiled dkfac'] / by['eager dkfac'],
        'dkfac / sgd, eager': by['eager dkfac'] / by['eager sgd'],
        'dkfac / sgd, compiled': by['compiled dkfac'] / by['compiled sgd'],
    }
    print(f"compile_step: {env['cpu'] if not cuda else env['device']}, {args.threads} threads, torch {torch.__version__}, "
          f"backend {args.backend}, load {env['load_average']}")
    print(f'model: BERT-shaped encoder, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, FFN {args.ffn}, '
          f'sequence {args.seq_len}, batch {args.batch}; K-FAC intervals ({args.factor_update_steps}, '
          f'{args.inv_update_steps}); {args.steps} timed steps per method after {args.warmup}, in lockstep')
    print(f"graphs compiled: {env['graphs'].get('unique_graphs', 0)}, graph breaks: {env['graph_breaks']}")
    print(f"{'method':>15} {'median ms':>10} {'p90 ms':>9}")
    for name, r in results.items():
        print(f"{name:>15} {r['median']:>10.2f} {r['p90']:>9.2f}")
    for name, value in ratios.items():
        print(f'{name}: {value:.3f}')
    if args.json:
        dump_json(args.json, {'environment': env, 'arguments': vars(args), 'results': results, 'ratios': ratios})
        print(f'compile_step: {args.json}')


if __name__ == '__main__':
    main()
