#!/usr/bin/env python3
"""What a dkfac step without updates costs the host: the operations it dispatches and, on CUDA, the kernels it
launches, eager and with ``cuda_graphs`` (issue 44).

For each model (bench/python_step.py's, with its shape flags) and each mode, a preconditioner at intervals that
make every step after the first a step without updates (factor and inverse intervals of 10**6), gradients zeroed in
place (``zero_grad(set_to_none=False)``, so that a graph can be replayed), and:

* one ``step()`` under ``torch.profiler``: the ATen operations it dispatched at the top level, and those that are
  not views (each a kernel or a few on a GPU; on a CPU the guard is read on the host before the writes, so the
  writes differ from a GPU's: KL clipping's scale applied by a host number, no ``where``), and on CUDA the kernels that ran and the host's launch calls (``cudaLaunchKernel`` and the
  like, ``cudaGraphLaunch``, ``cudaMemcpyAsync``);
* ``--step-repeats`` more steps, unprofiled: the host's time in ``step()`` (median and p90; on CUDA nothing in it waits
  for the device, so this is the time to launch the step's work) and, on CUDA, the device's time between events
  around it.

The graphs mode's report (``cuda_graph_report()``) says how many steps replayed; on a CPU there is no graph, and
that mode is the eager one (its report says why). Each ``--variant NAME:KEY=VALUE[,...]`` (bench/python_step.py's
flag: on CUDA with ``--schedule interleaved``, which this script ignores) is measured the same way, dkfac with those
options (e.g. ``eigen_adam:eigen_adam=true,kl_clip=0``).

    PYTHONPATH=build/python python bench/step_launches.py --device cpu --models resnet50,bert --bert-layers 4
    PYTHONPATH=build/python python bench/step_launches.py --device cuda --json launches.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.profiler import profile
from torch.profiler import ProfilerActivity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import python_step as ps  # noqa: E402  (models, batches, environment)

LAUNCH_CALLS = ('cudaLaunchKernel', 'cuLaunchKernel', 'cudaLaunchKernelExC', 'cuLaunchKernelEx', 'cudaGraphLaunch',
                'cudaMemcpyAsync', 'cudaMemsetAsync')


# ATen operations that only make a view (no kernel on any device).
VIEWS = {f'aten::{name}' for name in ('narrow', 'select', 'slice', 'reshape', 'view', 'transpose', 't', 'expand',
                                      'unsqueeze', 'squeeze', 'permute', 'as_strided', 'alias', 'detach')}


def count_events(prof: Any, cuda: bool) -> dict[str, Any]:
    """Top-level ATen operations (all, and those that are not views: each a kernel or a few on a GPU, the ten
    commonest named), CUDA kernels and launch calls of one profiled step()."""
    events = prof.events()
    top = [e for e in events if e.name.startswith('aten::')
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith('aten::'))]
    work = [e.name for e in top if e.name not in VIEWS]
    counts: dict[str, Any] = {'aten_ops': len(top), 'aten_ops_not_views': len(work),
                              'commonest': dict(collections.Counter(work).most_common(10))}
    if cuda:
        counts['kernels'] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        for call in LAUNCH_CALLS:
            n = sum(1 for e in events if e.name == call)
            if n:
                counts[call] = n
    return counts


def measure(model_name: str, mode: str, args: Any, options: dict[str, Any]) -> dict[str, Any]:
    """One model, one mode, dkfac with `options` (a --variant's) over the settings."""
    import dkfac
    cuda = args.device == 'cuda'
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = ps.build_model(model_name, args)
    model.train()
    batches, _ = ps.make_batches(args, model_name)
    lr = ps.lr_for(args, model_name)
    settings = dict(factor_update_steps=10**6, inv_update_steps=10**6, damping=args.damping, kl_clip=args.kl_clip,
                    lr=lr, skip_layers=['Embedding']) | options
    preconditioner = dkfac.KFACPreconditioner(model, cuda_graphs=mode == 'graphs', **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def backward(step: int) -> None:
        data, target = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(data).flatten(0, -2), target.flatten()).backward()

    step = 0
    for _ in range(3):  # the first step builds factors and state; the next two see the graph captured
        backward(step)
        preconditioner.step()
        step += 1
    backward(step)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        preconditioner.step()
        if cuda:
            torch.cuda.synchronize()
    step += 1
    counts = count_events(prof, cuda)
    host, device = [], []
    for _ in range(args.repeats):
        backward(step)
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        preconditioner.step()
        host.append(time.perf_counter() - t0)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            device.append(start.elapsed_time(end) / 1000)
        step += 1
    result = {'layers': len(preconditioner.layers), **counts,
              'host_ms': {'median': 1000 * statistics.median(host), 'p90': 1000 * ps.percentile(host, 90)},
              'cuda_graph_report': preconditioner.cuda_graph_report()}
    if device:
        result['device_ms'] = {'median': 1000 * statistics.median(device), 'p90': 1000 * ps.percentile(device, 90)}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--step-repeats', type=int, default=10, help='unprofiled steps timed per model and mode')
    parser.add_argument('--json', default=None, help='also write the results to this JSON file')
    ours, rest = parser.parse_known_args(argv)
    # The models, their shapes, the device and the settings are bench/python_step.py's, with its flags.
    args = ps.parse_args(rest)
    args.repeats = ours.step_repeats
    out = ours.json
    env = {'device': args.device, 'cpu': ps.cpu_model(), 'cores': os.cpu_count(), 'torch': torch.__version__,
           'torch_threads': torch.get_num_threads(), 'load_average_start': ps.load_average(), 'repeats': args.repeats,
           'models': {m: ps.describe_model(m, args) for m in args.models}}
    if args.device == 'cuda':
        env['gpu'] = ps.cuda_environment()
    results = []
    print(f"step_launches: {env['device']}, torch {env['torch']}, {env['torch_threads']} threads, "
          f"load {env['load_average_start']}")
    configurations = [('dkfac', {})] + list(args.variants.items())  # each --variant too (python_step's flag)
    for model_name in args.models:
        for (method, options), mode in ((c, m) for c in configurations for m in ('eager', 'graphs')):
            r = {'model': model_name, 'method': method, 'mode': mode, **measure(model_name, mode, args, options)}
            results.append(r)
            launches = ', '.join(f'{k} {r[k]}' for k in ('kernels',) + LAUNCH_CALLS if k in r)
            device = f", device {r['device_ms']['median']:.2f} ms" if 'device_ms' in r else ''
            report = r['cuda_graph_report']
            name = f"{model_name} {method}" if method != 'dkfac' else model_name
            print(f"  {name:<9} {mode:<7}{r['layers']} layers: {r['aten_ops']} top-level ATen ops, "
                  f"{r['aten_ops_not_views']} not views ({r['commonest']})"
                  f"{', ' + launches if launches else ''}; host {r['host_ms']['median']:.2f} ms "
                  f"(p90 {r['host_ms']['p90']:.2f}){device}; graphs: {report['replays']} replays, "
                  f"{report['captures']} captures{', off: ' + report['off'] if report['off'] else ''}")
            ps.release()
    env['load_average_end'] = ps.load_average()
    if out:
        with open(out, 'w') as f:
            json.dump({'environment': env, 'results': results}, f, indent=1)


if __name__ == '__main__':
    main()
