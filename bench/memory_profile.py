#!/usr/bin/env python3
"""Live CPU tensor bytes over a few training steps, for sgd / dkfac / kfac_pytorch, built as bench/python_step.py
builds them (its parse_args, make_batches and Runner), with the torch profiler's memory events.

Every allocation and free made through the c10 CPU allocator while profiling is recorded (profiling starts before
the model is built, so model, gradients, momentum, K-FAC state and transients are all in the live set). Per step
and phase (fwd_bwd, kfac_step, opt) it reports the live bytes at the phase start, the phase's peak, and the
allocations alive at the peak that were made during that step (the transients), grouped by the op chain that made
them and their size.

  .venv/bin/python bench/memory_profile.py --method dkfac --batch 64 --image 224 --fwd-twice --steps 2

(docs/PERFORMANCE.md, "On a GPU: NVIDIA H100": the reason for dkfac's larger K-FAC peak memory; outputs in
docs/perf/memory-profile-2026-11-26/.)
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / 'bench'))
sys.path.insert(0, str(REPO / 'build' / 'python'))
import python_step  # noqa: E402

MiB = 1 << 20
KFAC_SRC = str(REPO / '.gpu-bundle' / 'kfac-pytorch')  # scripts/gpu_bundle.sh puts kfac_pytorch v0.4.2 there


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument('--method', choices=['sgd', 'dkfac', 'kfac_pytorch'], required=True)
    p.add_argument('--model', default='resnet50', choices=['resnet50', 'bert'])
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--image', type=int, default=224)
    p.add_argument('--bert-layers', type=int, default=1)
    p.add_argument('--seq-len', type=int, default=128)
    p.add_argument('--intervals', default='1,2', help='factor,inverse (1,2: step 0 F+I (no state yet), step 1 F, '
                                                       'step 2 F+I with state: the kinds of step the GPU run has)')
    p.add_argument('--steps', type=int, default=3)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--top', type=int, default=12)
    p.add_argument('--stack', action='store_true', help='with_stack (Python frames in the op chains)')
    p.add_argument('--fwd-only', action='store_true', help='step 0 forward/backward only (the hooks on a factor step), '
                                                          'no preconditioner.step(): no eigendecompositions')
    p.add_argument('--fwd-twice', action='store_true',
                   help='two forward/backward passes and no preconditioner.step() (no eigendecompositions): the second '
                        'is a steady-state factor-step pass (kfac_pytorch folds into the factors its first pass made; '
                        'dkfac gets reset_batch() in between, so it captures one batch as on any factor step)')
    p.add_argument('--bench-args', default='', help='more bench/python_step.py flags, e.g. "--quick --classes 1000"')
    p.add_argument('--dkfac-option', action='append', default=[], metavar='KEY=VALUE',
                   help="a keyword for dkfac's preconditioner, e.g. fold_in_hooks=false (as python_step.py's --variant)")
    p.add_argument('--json', default=None)
    return p.parse_args()



def label_hooks() -> None:
    """Wraps both preconditioners' hooks in record_function('hook_fwd'/'hook_bwd'): same calls, same tensors."""
    import dkfac.base_preconditioner as dbp

    def forward_hook(capture):
        def hook(module, inputs, output):
            if not capture.enabled or not module.training or not torch.is_grad_enabled():
                return
            with record_function('hook_fwd'):
                capture.capture_input(inputs[0])
            if output.requires_grad:
                def grad_hook(grad):
                    with record_function('hook_bwd'):
                        return capture.capture_output_grad(grad)
                output.register_hook(grad_hook)
        return hook
    dbp.BaseKFACPreconditioner._forward_hook = staticmethod(forward_hook)
    sys.path.insert(0, KFAC_SRC)
    import kfac.base_preconditioner as kbp
    cls = kbp.BaseKFACPreconditioner
    save_input, save_grad = cls._save_input, cls._save_grad_output

    def _save_input(self, module, input_):
        with record_function('hook_fwd'):
            return save_input(self, module, input_)

    def _save_grad_output(self, module, grad_input, grad_output):
        with record_function('hook_bwd'):
            return save_grad(self, module, grad_input, grad_output)
    cls._save_input, cls._save_grad_output = _save_input, _save_grad_output


def main() -> None:
    a = parse()
    label_hooks()
    torch.set_num_threads(a.threads)
    argv = ['--models', a.model, '--batch-size', str(a.batch), '--batches', '1', '--intervals', a.intervals,
            '--kfac-pytorch-src', KFAC_SRC, '--image-size', str(a.image), '--bert-layers', str(a.bert_layers),
            '--seq-len', str(a.seq_len)] + a.bench_args.split()
    args = python_step.parse_args(argv)
    backends = python_step.import_backends(args)
    interval = tuple(int(x) for x in a.intervals.split(','))
    labels = []
    t0 = time.time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=a.stack) as prof:
        with record_function('build'):
            batches, _ = python_step.make_batches(args, a.model)
            extra = {key: python_step.option_value(key, value)
                     for key, value in (o.split('=', 1) for o in a.dkfac_option)}
            runner = python_step.Runner(a.method, a.model, None if a.method == 'sgd' else interval, args, batches,
                                        backends, extra if a.method == 'dkfac' else None)
        labels.append('build')
        data, target = batches[0]
        state_sizes = []
        for k in range(a.steps):
            with record_function(f's{k}/fwd_bwd'):
                runner.optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(runner.model(data).flatten(0, -2), target.flatten())
                loss.backward()
            if a.fwd_only or a.fwd_twice:
                labels.append(f's{k}/fwd_bwd')
                if a.fwd_only or k == 1:
                    break
                del loss
                if a.method == 'dkfac':
                    runner.preconditioner.reset_batch()
                continue
            with record_function(f's{k}/kfac_step'):
                if runner.preconditioner is not None:
                    runner.preconditioner.step()
            with record_function(f's{k}/opt'):
                runner.optimizer.step()
            del loss
            labels += [f's{k}/fwd_bwd', f's{k}/kfac_step', f's{k}/opt']
            if runner.preconditioner is not None:
                state_sizes.append(int(runner.preconditioner.memory_usage()['total']))
            print(f'step {k} done at {time.time() - t0:.0f} s', file=sys.stderr, flush=True)
    print(f'profiled in {time.time() - t0:.0f} s; analysing', file=sys.stderr, flush=True)
    analyse(prof, labels, a, state_sizes, runner)


def chain_of(node, stack: bool) -> str:
    names = []
    q = node.parent
    while q is not None and len(names) < 7:
        n = q.name
        if q.tag == _EventType.PyCall or q.tag == _EventType.PyCCall:
            if stack and ('kfac' in n or 'dkfac' in n or 'torch/nn/modules' in n):
                names.append(n.split('/')[-1])
        elif not (n.startswith('s') and '/' in n) and n != 'build':
            names.append(n)
        q = q.parent
    return ' < '.join(names) if names else '(python)'


def hook_of(node) -> str:
    q = node.parent
    while q is not None:
        if q.name in ('hook_fwd', 'hook_bwd'):
            return q.name
        q = q.parent
    return ''


def shapes_of(node) -> str:
    q = node.parent
    while q is not None and q.tag != _EventType.TorchOp:
        q = q.parent
    # the outermost aten op of this chain, for its input shapes
    top = None
    while q is not None and q.tag == _EventType.TorchOp and q.name.startswith('aten::'):
        top = q
        q = q.parent
    if top is None:
        return ''
    try:
        shapes = []
        for t in top.extra_fields.inputs:
            if hasattr(t, 'sizes'):
                shapes.append('x'.join(map(str, t.sizes)))
        return f'{top.name}({", ".join(shapes[:3])})'
    except Exception:  # noqa: BLE001
        return top.name


def analyse(prof, labels, a, state_sizes, runner) -> None:
    roots = prof.profiler.kineto_results.experimental_event_tree()
    allocs = []
    windows = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            e = node.extra_fields
            if e.device.type == 'cpu':
                allocs.append((node.start_time_ns, e.ptr, e.alloc_size, node))
        elif node.tag == _EventType.TorchOp and node.name in labels:
            windows[node.name] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    allocs.sort(key=lambda x: (x[0], x[2] > 0))  # at one time: frees first
    order = [l for l in labels if l in windows]

    def phase_at(t):
        for l in order:
            s, e = windows[l]
            if s <= t <= e:
                return l
        return 'other'

    # pass 1: live total; each phase's start value and peak (event index)
    live = 0
    info = {l: dict(start=None, peak=-1, peak_i=None) for l in order}
    cur_phase_idx = 0
    for i, (t, ptr, size, node) in enumerate(allocs):
        live += size
        for l in order:  # phases are sequential
            s, e = windows[l]
            if t < s:
                break
            if t <= e:
                d = info[l]
                if d['start'] is None:
                    d['start'] = live - size
                if live > d['peak']:
                    d['peak'], d['peak_i'] = live, i
                break
    # pass 2: live set at each peak
    targets = {d['peak_i']: l for l, d in info.items() if d['peak_i'] is not None}
    live_set = {}
    snaps = {}
    for i, (t, ptr, size, node) in enumerate(allocs):
        if size > 0:
            live_set[ptr] = (size, node, t)
        else:
            live_set.pop(ptr, None)
        if i in targets:
            snaps[targets[i]] = dict(live_set)
    step_start = {}
    for l in order:
        if l.endswith('/fwd_bwd'):
            step_start[l.split('/')[0]] = windows[l][0]
    out = dict(method=a.method, model=a.model, batch=a.batch, image=a.image, intervals=a.intervals,
               state_total_mib=[s / MiB for s in state_sizes], phases={})
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    out['params_mib'] = params / MiB
    print(f'== {a.method} {a.model} batch {a.batch} image {a.image} intervals {a.intervals}; params {params / MiB:.1f} '
          f'MiB; memory_usage total per step (MiB): {[round(s / MiB, 1) for s in state_sizes]}')
    for l in order:
        d = info[l]
        if d['start'] is None:
            continue
        step = l.split('/')[0]
        snap = snaps.get(l, {})
        s0 = step_start.get(step, 0)
        groups = collections.defaultdict(lambda: [0, 0, ''])
        by_phase = collections.defaultdict(int)
        old = 0
        for ptr, (size, node, t) in snap.items():
            if t < s0:
                old += size
                continue
            ph = phase_at(t).split('/')[-1]
            hk = hook_of(node)
            if hk:
                ph = hk
            by_phase[ph] += size
            key = (ph, chain_of(node, a.stack), size)
            g = groups[key]
            g[0] += size
            g[1] += 1
            if not g[2]:
                g[2] = shapes_of(node)
        top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:a.top]
        pnode = allocs[d['peak_i']][3]
        peak_at = (hook_of(pnode) or 'main') + ': ' + chain_of(pnode, a.stack)[:100] + '  ' + shapes_of(pnode)[:80]
        rec = dict(start_mib=d['start'] / MiB, peak_mib=d['peak'] / MiB, rise_mib=(d['peak'] - d['start']) / MiB,
                   live_from_before_step_mib=old / MiB, peak_at=peak_at,
                   made_this_step_by_phase_mib={k: v / MiB for k, v in by_phase.items()},
                   top=[dict(phase=k[0], chain=k[1], bytes_each=k[2], count=v[1], mib=v[0] / MiB, op=v[2])
                        for k, v in top])
        out['phases'][l] = rec
        print(f'-- {l}: start {rec["start_mib"]:.1f} MiB, peak {rec["peak_mib"]:.1f} MiB (rise {rec["rise_mib"]:.1f}); '
              f'at the peak: {old / MiB:.1f} MiB from before the step, made this step: '
              + ', '.join(f'{k} {v / MiB:.1f}' for k, v in by_phase.items()) + f'\n   peak made by {peak_at}')
        for r in rec['top']:
            print(f'   {r["mib"]:8.1f} MiB  {r["count"]:4d} x {r["bytes_each"] / MiB:8.2f} MiB  [{r["phase"]}] '
                  f'{r["chain"][:110]}  {r["op"][:90]}')
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(out, f, indent=1)


if __name__ == '__main__':
    main()
