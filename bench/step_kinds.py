#!/usr/bin/env python3
"""Each kind of K-FAC step timed on its own, composed into any (factor, inverse) interval, against its floor.

A K-FAC job runs three kinds of step: a **non-update** step (precondition with the state it has), a **factor**
step (that, and fold this step's batch into the running factors) and an **inverse** step (that, and the factors'
eigendecompositions). Their costs differ by three orders of magnitude on BERT-Large, so one amortised figure per
interval hides where the time goes and costs a whole inverse period per window. This benchmark instead runs
SGD, dkfac and kfac_pytorch (same models, data and settings as bench/python_step.py: eigen, damping 0.003,
kl_clip 0.001, factor_decay 0.95, float32 inverses) each alone, and times blocks of one kind of step at a time:

* the kind of every step is fixed before the run by a schedule both preconditioners accept (``factor_update_steps``
  and ``inv_update_steps`` given as functions of the step: 1 where that step is of the kind, a step count no step
  reaches elsewhere), so both run exactly the same sequence;
* after the warm-up (step 0 is an inverse step in both), blocks of each kind alternate (the order rotating per
  repeat): ``--block-steps`` steps of a kind per block, ``--blocks`` blocks per kind;
* a block's time is its wall time between ``torch.cuda.synchronize()`` calls divided by its steps (on the CPU:
  host time); per-step times and the forward+backward / ``preconditioner.step()`` / optimizer splits come from
  CUDA events (bench/python_step.py's Runner); dkfac's phases from ``phase_times(total=True)`` around a block.

Reported per model: each method's time per kind (median and p90 over its blocks, the per-step median and p90
over all the kind's steps), the K-FAC overhead per kind (kind - SGD step), each (factor f, inverse i) interval's
amortised overhead composed from them::

    overhead(f, i) = [inverse + (i/f - 1) factor + (i - i/f) non-update] / i - SGD,

and dkfac / kfac_pytorch; each preconditioner's peak memory above SGD's; and dkfac's phases per kind against
their floors, read off the model's layers (Linear and Conv2d: rows = samples x positions, a = inputs (+1 for a
bias), g = outputs) and rates measured on the device in the same process:

* factors: 2 rows (a^2 + g^2) FLOPs per step (a full gram; half with a triangle-only kernel), at the GEMM rate;
* second order: 4 d^3 FLOPs per eigendecomposition (two per layer): the Householder tridiagonalisation and the
  accumulation of its reflectors (8/3 d^3) and the tridiagonal eigenvectors' product back (4/3 d^3, divide and
  conquer without deflation), at the GEMM rate, which no eigensolver reaches: a bound, not a target;
* precondition: 4 g a (g + a) FLOPs (the gradient rotated into both eigenbases and back), at the GEMM rate, or
  the bytes of the state it must read (Q_A, Q_G, the eigenvalues' outer product, the gradient in and out) at the
  copy bandwidth, whichever is the larger, per layer;

GEMM rate: the best of ``torch.mm`` of two n x n float32 matrices, n = 2048, 4096 and 8192 on CUDA (512 and 1024 on
the CPU), each the median of 10 (TF32 as the run has it: off unless --tf32); copy bandwidth: ``copy_`` of 256 MiB, read and write counted, median of 10.

    python bench/step_kinds.py --device cuda --kfac-pytorch-src .gpu-bundle/kfac-pytorch --json k.json --markdown k.md
    python bench/step_kinds.py --quick --models resnet50,bert --kfac-pytorch-src .gpu-bundle/kfac-pytorch  # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_probe  # noqa: E402  (its Timer)
import python_step as ps  # noqa: E402  (models, batches, backends, the Runner, statistics and environment)

KINDS = ('non_update', 'factor', 'inverse')
NEVER = 2**31 - 1  # an interval no step of a benchmark reaches: step % NEVER == 0 only at step 0
PHASE_FLOORS = {'factors': 'factors', 'second_order': 'second_order', 'precondition': 'precondition'}
# Per device: (blocks per kind, steps per block for non_update, factor, inverse, warm-up steps).
DEFAULTS = {'cpu': (3, {'non_update': 5, 'factor': 5, 'inverse': 1}, 2),
            'cuda': (3, {'non_update': 10, 'factor': 10, 'inverse': 1}, 3)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], add_help=True)
    parser.add_argument('--blocks', type=int, default=None, help='blocks per kind of step (cuda 3, cpu 3)')
    parser.add_argument('--block-steps', default=None,
                        help='steps per block, "non_update=10,factor=10,inverse=1" (the CUDA default)')
    parser.add_argument('--tf32', action='store_true', help='allow TF32 in matmuls (off by default, as the tests)')
    parser.add_argument('--variant', action='append', default=[], metavar='NAME:KEY=VALUE[,KEY=VALUE]',
                        help='also measure dkfac with these options, as method NAME (e.g. '
                             'tf32:precondition_dtype=tf32, bf16:inv_dtype=bfloat16 or '
                             'eigenadam:eigen_adam=true,kl_clip=0); repeatable')
    parser.add_argument('--no-kfac-pytorch-run', action='store_true',
                        help='leave kfac_pytorch out of this run (its figures then come from another run)')
    parser.add_argument('--budget-s', type=float, default=None,
                        help='stop adding blocks to a method once its blocks passed this many seconds (cuda 90)')
    ours, rest = parser.parse_known_args(argv)
    # The models, data, settings and backends are bench/python_step.py's, with its flags.
    args = ps.parse_args(rest + ['--schedule', 'sequential'])
    blocks, steps, warmup = DEFAULTS[args.device]
    args.blocks = ours.blocks or (1 if args.quick else blocks)
    args.block_steps = dict(steps)
    if ours.block_steps:
        for item in ours.block_steps.split(','):
            kind, _, n = item.partition('=')
            if kind.strip() not in KINDS or not n.strip().isdigit() or int(n) < 1:
                parser.error(f'--block-steps {ours.block_steps!r}: expected kind=N with kind in {KINDS}, N >= 1')
            args.block_steps[kind.strip()] = int(n)
    if args.quick and not ours.block_steps:
        args.block_steps = {'non_update': 2, 'factor': 2, 'inverse': 1}
    args.warmup = warmup if '--warmup' not in rest else args.warmup
    args.tf32 = ours.tf32
    args.variants = ps.parse_variants(ours.variant, parser.error)
    args.skip_kfac_pytorch = ours.no_kfac_pytorch_run
    args.kind_budget_s = ours.budget_s if ours.budget_s is not None else (90.0 if args.device == 'cuda' else 0.0)
    return args


# --- the schedule ------------------------------------------------------------------------------------------
class KindSchedule:
    """The kind of every K-FAC step, fixed before the run; its two functions are both preconditioners' intervals."""

    def __init__(self, warmup: int, blocks: list[tuple[str, int]]) -> None:
        # Step 0 is an inverse step in both libraries (step % n == 0); the rest of the warm-up is non-update.
        self.kinds = ['inverse'] + ['non_update'] * max(0, warmup - 1)
        self.blocks = []
        for kind, n in blocks:
            self.blocks.append((kind, len(self.kinds), n))
            self.kinds += [kind] * n

    def kind(self, step: int) -> str:
        return self.kinds[step] if step < len(self.kinds) else 'non_update'

    def factor_update_steps(self, step: int) -> int:
        return 1 if self.kind(step) in ('factor', 'inverse') else NEVER

    def inv_update_steps(self, step: int) -> int:
        return 1 if self.kind(step) == 'inverse' else NEVER


def block_order(args: argparse.Namespace) -> list[tuple[str, int]]:
    order = []
    for repeat in range(args.blocks):
        rotated = KINDS[repeat % 3:] + KINDS[:repeat % 3]
        order += [(kind, args.block_steps[kind]) for kind in rotated]
    return order


# --- the model's shapes and the device's rates --------------------------------------------------------------
def layer_shapes(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> list[dict[str, int]]:
    """Rows, a and g of each Linear and Conv2d, read off one forward pass (the layers both libraries register)."""
    shapes: list[dict[str, int]] = []

    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        bias = int(module.bias is not None)
        if isinstance(module, torch.nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1]
            a = module.in_channels // module.groups * k + bias
            rows = output.shape[0] * output.shape[2] * output.shape[3]
            g = module.out_channels
        else:
            a, g = module.in_features + bias, module.out_features
            rows = output.numel() // g
        shapes.append({'rows': int(rows), 'a': int(a), 'g': int(g)})

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    try:
        with torch.no_grad():
            model(batch[0])
    finally:
        for h in handles:
            h.remove()
    return shapes


def device_rates(device: str) -> dict[str, float]:
    """float32 GEMM FLOP/s (as the run's TF32 setting has it) and copy bytes/s, medians of 10."""
    timed = kernel_probe.Timer(device, repeats=10)
    gemm, best_n = 0.0, 0
    for n in ((2048, 4096, 8192) if device == 'cuda' else (512, 1024)):  # the best rate any of them reaches
        x, y = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        rate = 2 * n**3 / (timed(lambda: torch.mm(x, y))['median_ms'] / 1000)
        if rate > gemm:
            gemm, best_n = rate, n
    elements = (256 if device == 'cuda' else 64) * 2**20 // 4
    src, dst = torch.randn(elements, device=device), torch.empty(elements, device=device)
    copy = 2 * 4 * elements / (timed(lambda: dst.copy_(src))['median_ms'] / 1000)
    return {'gemm_flops': gemm, 'gemm_n': best_n, 'copy_bytes_per_s': copy, 'copy_mib': elements * 4 // 2**20}


def floors(shapes: list[dict[str, int]], rates: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each phase's FLOPs (bytes) and its floor in ms, per step of the kinds that run it."""
    factor_flops = sum(2 * s['rows'] * (s['a']**2 + s['g']**2) for s in shapes)
    eigh_flops = sum(4 * (s['a']**3 + s['g']**3) for s in shapes)
    precondition_flops = sum(4 * s['g'] * s['a'] * (s['g'] + s['a']) for s in shapes)
    precondition_bytes = sum(4 * (s['a']**2 + s['g']**2 + 3 * s['g'] * s['a']) for s in shapes)
    precondition_s = sum(max(4 * s['g'] * s['a'] * (s['g'] + s['a']) / rates['gemm_flops'],
                             4 * (s['a']**2 + s['g']**2 + 3 * s['g'] * s['a']) / rates['copy_bytes_per_s'])
                         for s in shapes)
    return {
        'factors': {'flops': factor_flops, 'floor_ms': 1000 * factor_flops / rates['gemm_flops'],
                    'triangle_floor_ms': 500 * factor_flops / rates['gemm_flops']},
        'second_order': {'flops': eigh_flops, 'floor_ms': 1000 * eigh_flops / rates['gemm_flops']},
        'precondition': {'flops': precondition_flops, 'bytes': precondition_bytes, 'floor_ms': 1000 * precondition_s},
    }


# --- measuring ------------------------------------------------------------------------------------------------
def measure_method(method: str, model_name: str, args: argparse.Namespace, batches: list,
                   backends: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """One method alone: built, warmed up, its blocks of each kind (SGD: plain steps), its peak memory. A
    variant's name (--variant) is dkfac with its options."""
    extra = args.variants.get(method)
    backend = 'dkfac' if extra is not None else method
    ps.release()
    cuda = args.device == 'cuda'
    runner = None
    label = f'  {model_name} {method}'
    try:
        schedule = KindSchedule(args.warmup, block_order(args))
        interval = None if method == 'sgd' else (schedule.factor_update_steps, schedule.inv_update_steps)
        runner = ps.Runner(backend, model_name, interval, args, batches, backends, extra)
        for _ in range(args.warmup):
            runner.step(None)
        kinds = {'sgd': [('sgd', args.block_steps['non_update'])] * args.blocks} if method == 'sgd' else None
        plan = kinds['sgd'] if kinds else [(k, n) for k, _, n in schedule.blocks]
        records: dict[str, dict[str, list[float]]] = {}
        blocks: dict[str, list[float]] = {}
        spent = 0.0
        for kind, n in plan:
            if runner.preconditioner is not None:
                at = runner.preconditioner.steps
                assert schedule.kind(at) == kind, f'step {at} is a {schedule.kind(at)} step, the block is {kind}'
            if args.kind_budget_s > 0 and spent > args.kind_budget_s and len(blocks.get(kind, [])) > 0:
                # Past the budget: keep one block per kind, but the schedule's steps still run in order.
                log(f'{label}: {kind} block skipped (budget {args.kind_budget_s:g} s spent)')
                for _ in range(n):
                    runner.step(None)
                continue
            rec = records.setdefault(kind, {k: [] for k in ('step',) + ps.SPLITS})
            seconds = runner.window(n, rec)
            blocks.setdefault(kind, []).append(seconds)
            spent += seconds * n
            log(f'{label} {kind}: {1000 * seconds:.1f} ms per step over {n}  [load {ps.load_average()}]')
        entry: dict[str, Any] = {'kinds': {}}
        for kind, times in blocks.items():
            rec = records[kind]
            e = {'block_ms': {'median': 1000 * statistics.median(times), 'p90': 1000 * ps.percentile(times, 90),
                              'blocks': [1000 * t for t in times]},
                 'per_step_ms': ps.summary(rec['step']), 'splits_ms': {k: ps.summary(rec[k]) for k in ps.SPLITS},
                 'steps': sum(args.block_steps.get(kind, args.block_steps['non_update']) for _ in times)}
            if runner.has_phases:
                e['phases_ms'] = {p: 1000 * statistics.fmean(rec[p]) for p in ps.DKFAC_PHASES if rec.get(p)}
            entry['kinds']['sgd' if method == 'sgd' else kind] = e
        entry['final_loss'] = runner.loss
        entry['peak_memory_bytes'] = torch.cuda.max_memory_allocated() if cuda else None
        if runner.preconditioner is not None:
            entry['memory_usage_bytes'] = int(runner.preconditioner.memory_usage()['total'])
            entry['registered_layers'] = ps.registered_layers(runner.preconditioner)
            if (extra or {}).get('cuda_graphs'):  # how many steps a graph served, and why the others ran eagerly
                entry['cuda_graphs'] = runner.preconditioner.cuda_graph_report()
                log(f'{label}: cuda_graphs {entry["cuda_graphs"]}')
        return entry
    except Exception as error:  # noqa: BLE001 -- one method failing (e.g. out of memory) is reported
        log(f'{label}: {type(error).__name__}: {error}')
        return {'error': f'{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ""}'}
    finally:
        del runner
        ps.release()


def compose(result: dict[str, Any], intervals: list[tuple[int, int]]) -> None:
    """Overheads per kind and per interval, and dkfac / kfac_pytorch, from the measured kinds."""
    methods = result['methods']
    sgd = methods.get('sgd', {}).get('kinds', {}).get('sgd')
    if sgd is None:
        return
    base = sgd['block_ms']['median']
    for method, e in methods.items():
        if method == 'sgd' or 'error' in e or set(e['kinds']) != set(KINDS):
            continue
        t = {k: e['kinds'][k]['block_ms']['median'] for k in KINDS}
        e['overhead_per_kind_ms'] = {k: t[k] - base for k in KINDS}
        e['intervals'] = {}
        for f, i in intervals:
            amortised = (t['inverse'] + (i // f - 1) * t['factor'] + (i - i // f) * t['non_update']) / i
            e['intervals'][f'{f},{i}'] = {'step_ms': amortised, 'overhead_ms': amortised - base,
                                           'x_sgd': amortised / base}
        if e.get('peak_memory_bytes') is not None and methods['sgd'].get('peak_memory_bytes') is not None:
            e['kfac_memory_bytes'] = e['peak_memory_bytes'] - methods['sgd']['peak_memory_bytes']
    d, k = methods.get('dkfac', {}), methods.get('kfac_pytorch', {})
    if 'intervals' in d and 'intervals' in k:
        result['ratios'] = {key: d['intervals'][key]['overhead_ms'] / k['intervals'][key]['overhead_ms']
                            for key in d['intervals'] if k['intervals'][key]['overhead_ms'] > 0}
        result['kind_ratios'] = {kind: d['overhead_per_kind_ms'][kind] / k['overhead_per_kind_ms'][kind]
                                 for kind in KINDS if k['overhead_per_kind_ms'][kind] > 0}


# --- output -----------------------------------------------------------------------------------------------------
def report(results: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    fmt = ps.fmt
    lines = ['step_kinds: ' + json.dumps(env, sort_keys=True), '']
    rates = env['rates']
    lines.append(f"Rates measured here: float32 GEMM {rates['gemm_flops'] / 1e12:.2f} TFLOP/s ({rates['gemm_n']}^3, "
                 f"TF32 {'on' if args.tf32 else 'off'}), copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s "
                 f"({rates['copy_mib']} MiB).")
    lines.append('Time per step of each kind, ms: block median / p90 over the blocks; per step median / p90 (events).')
    lines.append(f"{'model':<10}{'method':<14}{'kind':<12}{'blocks':>7}{'block med/p90':>18}{'step med/p90':>18}"
                 f"{'kfac.step med':>15}{'overhead':>10}")
    for r in results:
        for method, e in r['methods'].items():
            if 'error' in e:
                lines.append(f"{r['model']:<10}{method:<14}failed: {e['error']}")
                continue
            for kind, k in e['kinds'].items():
                over = e.get('overhead_per_kind_ms', {}).get(kind, math.nan)
                lines.append(f"{r['model']:<10}{method:<14}{kind:<12}{len(k['block_ms']['blocks']):>7}"
                             f"{fmt(k['block_ms']['median'], 9)} /{fmt(k['block_ms']['p90'], 7)}"
                             f"{fmt(k['per_step_ms']['median'], 9)} /{fmt(k['per_step_ms']['p90'], 7)}"
                             f"{fmt(k['splits_ms']['kfac_step']['median'], 15)}{fmt(over, 10)}")
    lines += ['', 'dkfac phases per kind, ms per step (phase_times over each block), against the floor (x floor):']
    lines.append(f"{'model':<10}{'method':<14}{'kind':<12}" + ''.join(f'{p:>22}' for p in ps.DKFAC_PHASES))
    for r, method in [(r, m) for r in results for m in r['methods'] if m == 'dkfac' or m in args.variants]:
        e = r['methods'][method]
        for kind, k in e.get('kinds', {}).items():
            cells = []
            for p in ps.DKFAC_PHASES:
                value = k.get('phases_ms', {}).get(p, math.nan)
                floor = r['floors'].get(PHASE_FLOORS.get(p, ''), {}).get('floor_ms')
                runs = value > 0.0005 and floor
                cells.append(f"{fmt(value, 9)}{f' ({value / floor:5.2f}x)' if runs else ' ' * 9:>13}")
            lines.append(f"{r['model']:<10}{method:<14}{kind:<12}" + ''.join(f'{c:>22}' for c in cells))
    lines += ['', 'Floors per step of the kinds that run them (FLOPs at the GEMM rate; precondition: or its bytes):']
    for r in results:
        f = r['floors']
        lines.append(f"  {r['model']}: {r['layers']} layers; factors {f['factors']['flops'] / 1e9:.1f} GFLOP = "
                     f"{f['factors']['floor_ms']:.2f} ms ({f['factors']['triangle_floor_ms']:.2f} ms triangle only); "
                     f"second order {f['second_order']['flops'] / 1e9:.0f} GFLOP = {f['second_order']['floor_ms']:.1f} "
                     f"ms; precondition {f['precondition']['flops'] / 1e9:.1f} GFLOP, "
                     f"{f['precondition']['bytes'] / 2**20:.0f} MiB = {f['precondition']['floor_ms']:.2f} ms")
        for method in [m for m in r['methods'] if m == 'dkfac' or m in args.variants]:
            e = r['methods'][method]
            if 'overhead_per_kind_ms' in e:
                over = e['overhead_per_kind_ms']['non_update']
                lines.append(f"  {r['model']}: {method}'s non-update overhead {over:.2f} ms = "
                             f"{over / f['precondition']['floor_ms']:.2f}x the float32 floor (exact mode's goal <= 1.2x)")
    lines += ['', 'Amortised over an interval (f, i), composed from the kinds: step ms, overhead ms, x SGD; ratios:']
    for r in results:
        for key in args.interval_keys:
            cells = []
            for method in [m for m in r['methods'] if m != 'sgd']:
                e = r['methods'].get(method, {}).get('intervals', {}).get(key)
                if e:
                    cells.append(f"{method} {e['step_ms']:.1f} ms, overhead {e['overhead_ms']:.1f} ms, "
                                 f"{e['x_sgd']:.2f}x SGD")
            ratio = r.get('ratios', {}).get(key)
            lines.append(f"  {r['model']} ({key}): " + '; '.join(cells)
                         + (f'; overhead ratio dkfac / kfac_pytorch {ratio:.2f}' if ratio is not None else ''))
        if r.get('kind_ratios'):
            lines.append(f"  {r['model']} per kind, overhead dkfac / kfac_pytorch: "
                         + ', '.join(f'{k} {v:.2f}' for k, v in r['kind_ratios'].items()))
    lines += ['', 'Memory, MiB: peak (max_memory_allocated of the method alone), K-FAC = peak - SGD peak, '
              'memory_usage()' + ('' if args.device == 'cuda' else ' (CPU: peaks not measured)')]
    for r in results:
        for method, e in r['methods'].items():
            if 'error' in e:
                continue
            lines.append(f"  {r['model']:<10}{method:<14}peak {ps.fmt_mib(e.get('peak_memory_bytes'))}  K-FAC "
                         f"{ps.fmt_mib(e.get('kfac_memory_bytes'))}  memory_usage() "
                         f"{ps.fmt_mib(e.get('memory_usage_bytes'))}  layers {e.get('registered_layers') or '-'}")
    return '\n'.join(lines)


def markdown(results: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    where = (f"{env['gpu']['device']}, torch {env['torch']}, CUDA {env['gpu']['cuda']}" if args.device == 'cuda'
             else f"{env['cpu']}, {env['cores']} cores, torch {env['torch']}")
    rates = env['rates']
    lines = [f'### bench/step_kinds.py on {where}', '',
             f"float32 GEMM {rates['gemm_flops'] / 1e12:.2f} TFLOP/s, copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s "
             f"measured in the run; TF32 {'on' if args.tf32 else 'off'}; blocks of {args.block_steps} steps, "
             f"{args.blocks} per kind; eigen, damping {args.damping}, kl_clip {args.kl_clip}, float32 inverses. "
             + '; '.join(f'{m}: {ps.describe_model(m, args)}' for m in args.models) + '.', '',
             '| model | method | non-update (ms) | factor (ms) | inverse (ms) | '
             + ' | '.join(f'overhead ({k}) (ms)' for k in args.interval_keys)
             + ' | K-FAC memory (MiB) |', '|---|---|---|---|---|' + '---|' * len(args.interval_keys) + '---|']
    for r in results:
        for method, e in r['methods'].items():
            if 'error' in e:
                lines.append(f"| {r['model']} | {method} | failed: {e['error']} |")
                continue
            kinds = e['kinds']
            cell = lambda k: (f"{kinds[k]['block_ms']['median']:.1f} (p90 {kinds[k]['block_ms']['p90']:.1f})"
                              if k in kinds else '')
            row = [r['model'], method] + ([cell('sgd'), '', ''] if method == 'sgd' else [cell(k) for k in KINDS])
            row += [f"{e['intervals'][k]['overhead_ms']:.1f}" if 'intervals' in e else '' for k in args.interval_keys]
            row.append(ps.fmt_mib(e.get('kfac_memory_bytes'), 0).strip() if method != 'sgd' else '')
            lines.append('| ' + ' | '.join(row) + ' |')
        if r.get('ratios'):
            lines.append(f"| {r['model']} | dkfac / kfac_pytorch | "
                         + ' | '.join(f"{r['kind_ratios'].get(k, math.nan):.2f}" for k in KINDS) + ' | '
                         + ' | '.join(f"{r['ratios'].get(k, math.nan):.2f}" for k in args.interval_keys) + ' | |')
    return '\n'.join(lines) + '\n'


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Threads and TF32 as the arguments say; the backends (bench/fast_mode_error.py starts the same way)."""
    torch.set_num_threads(args.threads)
    if args.device == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    return ps.import_backends(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backends = prepare(args)
    args.interval_keys = [f'{f},{i}' for f, i in args.intervals]
    methods = ['sgd'] + [m for m in ps.METHODS[1:] if m in backends
                         and not (m == 'kfac_pytorch' and args.skip_kfac_pytorch)]
    if args.variants:
        if 'dkfac' not in backends:
            raise SystemExit('step_kinds: --variant needs dkfac')
        methods += list(args.variants)
    env: dict[str, Any] = {
        'cpu': ps.cpu_model(), 'cores': os.cpu_count(), 'torch': torch.__version__,
        'torch_threads': torch.get_num_threads(), 'python': platform.python_version(), 'device': args.device,
        'dkfac': getattr(backends.get('dkfac'), '__version__', None),
        'kfac_pytorch': getattr(backends.get('kfac_pytorch'), '__version__', None),
        'models': args.models, 'models_desc': {m: ps.describe_model(m, args) for m in args.models},
        'blocks': args.blocks, 'block_steps': args.block_steps, 'warmup': args.warmup, 'seed': args.seed,
        'tf32': args.tf32, 'keep_gradients': args.keep_gradients, 'kind_budget_s': args.kind_budget_s,
        'load_average_start': ps.load_average(),
        'variants': {name: {k: str(v) for k, v in o.items()} for name, o in args.variants.items()},
    }
    if args.device == 'cuda':
        env['gpu'] = ps.cuda_environment()
    env['rates'] = device_rates(args.device)
    log = ps.log
    log(f"step_kinds: {env.get('gpu', {}).get('device', env['cpu'])}, torch {env['torch']}, methods {methods}, "
        f"GEMM {env['rates']['gemm_flops'] / 1e12:.2f} TFLOP/s, copy {env['rates']['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    for model_name in args.models:
        batches, data = ps.make_batches(args, model_name)
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            probe = ps.build_model(model_name, args)
        shapes = layer_shapes(probe, batches[0])
        del probe
        result: dict[str, Any] = {'model': model_name, 'data': data, 'layers': len(shapes),
                                  'floors': floors(shapes, env['rates']), 'methods': {}}
        for method in methods:
            result['methods'][method] = measure_method(method, model_name, args, batches, backends, log)
            compose(result, args.intervals)
            if args.json:
                ps.write_json(args.json, env, results + [result], partial=True)
        results.append(result)
    env['wall_s'] = round(time.perf_counter() - started, 1)
    env['load_average_end'] = ps.load_average()
    ps.write_outputs('step_kinds', args, env, results, report(results, env, args), markdown(results, env, args))


if __name__ == '__main__':
    main()
