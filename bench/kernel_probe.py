#!/usr/bin/env python3
"""The kernels a K-FAC step is made of, timed alone on one device, to choose how dkfac runs them.

Issue 44 asks which way each kernel is fastest before dkfac commits to one; this measures the choices on the
device it runs on (float32, TF32 off, as the exact mode computes), each the median of --repeats timed runs
after one untimed run, between ``torch.cuda.synchronize()`` calls:

* **eigh** of one symmetric positive definite matrix per size (BERT-Large's widths 1024/1025 and 4096/4097,
  ResNet-50's 576, 2304 and 4608), through cuSOLVER and through MAGMA
  (``torch.backends.cuda.preferred_linalg_library``), and the float64 retry's cost;
* **one encoder layer's decompositions** (BERT-Large: ten of width 1025 or 1024, one 4096 and one 4097), one
  after another on one stream, against the same split over 2 and 4 host threads each on its own CUDA stream,
  and against ``torch.linalg.eigh`` of the stacked same-shaped matrices (batched);
* **GEMM alignment**: the preconditioning products Q_G^T grad Q_A at widths 1025 and 4097 (a bias column)
  against 1024 and 4096, as TFLOP/s; at the odd widths also three ways to align them to a multiple of 8: the same
  matrices with a padded leading dimension, matrices held padded (identity-padded eigenbases, zero gradient
  columns), and padding copies made at each call;
* **the gram** x^T x of a factor (4096 rows): ``mm`` of the full matrix against its upper triangle in blocks;
* **refresh against eigh** per size: the core's full eigendecomposition against its refresh of the previous
  basis (``eigh_interval``, dkfac._C's kernels: PYTHONPATH=build/python), with the refresh's error.

    python bench/kernel_probe.py --device cuda --json probe.json
    python bench/kernel_probe.py --device cpu --quick          # the code paths, small sizes
    PYTHONPATH=build/python python bench/kernel_probe.py --device cpu --probe refresh --sizes 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import python_step  # noqa: E402  (dump_json)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--quick', action='store_true', help='small sizes (a CPU run of the code paths)')
    parser.add_argument('--budget-s', type=float, default=120.0, help='stop starting new probes after this long')
    parser.add_argument('--probe', action='append', choices=['gemm', 'one_layer_eigh', 'eigh', 'refresh'],
                        help='run only these probes (repeatable; default: all)')
    parser.add_argument('--sizes', type=int, nargs='+', default=None,
                        help='the eigh and refresh probes\' widths (default: BERT-Large\'s and ResNet-50\'s)')
    parser.add_argument('--json', default=None)
    return parser.parse_args(argv)


class Timer:
    def __init__(self, device: str, repeats: int) -> None:
        self.device, self.repeats = device, repeats

    def sync(self) -> None:
        if self.device == 'cuda':
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> dict[str, float]:
        fn()
        times = []
        for _ in range(self.repeats):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return {'median_ms': 1000 * statistics.median(times), 'min_ms': 1000 * min(times),
                'max_ms': 1000 * max(times)}


def spd(d: int, device: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device='cpu').manual_seed(seed + d)
    x = torch.randn(2 * d, d, generator=g, dtype=torch.float64)
    return (x.t() @ x / (2 * d) + 1e-3 * torch.eye(d, dtype=torch.float64)).to(device=device, dtype=dtype)


def eigh_backends(args: argparse.Namespace, timer: Timer, sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    libraries = ['cusolver', 'magma'] if args.device == 'cuda' else ['default']
    for d in sizes:
        m = spd(d, args.device)
        row: dict[str, Any] = {}
        for library in libraries:
            if args.device == 'cuda':
                torch.backends.cuda.preferred_linalg_library(library)
            try:
                row[library] = timer(lambda: torch.linalg.eigh(m))
            except RuntimeError as error:  # a backend this build lacks
                row[library] = {'error': str(error).splitlines()[0]}
        if args.device == 'cuda':
            torch.backends.cuda.preferred_linalg_library('default')
        m64 = m.double()
        row['float64'] = timer(lambda: torch.linalg.eigh(m64))
        out[str(d)] = row
        print(f'eigh {d}: ' + ', '.join(f"{k} {v['median_ms']:.1f} ms" for k, v in row.items()
                                        if isinstance(v, dict) and 'median_ms' in v), flush=True)
    return out


def refresh_vs_eigh(args: argparse.Namespace, timer: Timer, sizes: list[int]) -> dict[str, Any]:
    """The core's full eigendecomposition of a factor against its refresh (Options::eigh_interval) from the
    eigenbasis of the factor one update earlier (F' = 0.95 F + 0.05 B, a new batch B), float32: the time of each,
    and how far each refreshed basis rebuilds F' (||Q diag(d) Q^T - F'|| / ||F'||; eigh's is rounding)."""
    from dkfac import _C  # the core's kernels (dkfac/math/second_order.h)
    out: dict[str, Any] = {}
    for d in sizes:
        before = spd(d, args.device)
        after = 0.95 * before + 0.05 * spd(d, args.device, seed=1)
        vectors, values = _C.eigen_decompose(before)
        full = timer(lambda: _C.eigen_decompose(after))
        refresh = timer(lambda: _C.refresh_eigenbasis(after, vectors, values))
        q, e = _C.refresh_eigenbasis(after, vectors, values)
        error = (torch.linalg.matrix_norm((q * e) @ q.t() - after) / torch.linalg.matrix_norm(after)).item()
        out[str(d)] = {'eigh': full, 'refresh': refresh, 'refresh_rebuild_error': error,
                       'eigh_over_refresh': full['median_ms'] / refresh['median_ms']}
        print(f"refresh {d}: eigh {full['median_ms']:.1f} ms, refresh {refresh['median_ms']:.1f} ms "
              f"({out[str(d)]['eigh_over_refresh']:.2f}x), rebuild error {error:.2e}", flush=True)
    return out


def concurrent_eigh(args: argparse.Namespace, timer: Timer, widths: list[int]) -> dict[str, Any]:
    mats = [spd(d, args.device, seed=i) for i, d in enumerate(widths)]
    out: dict[str, Any] = {'widths': widths}
    out['one_stream'] = timer(lambda: [torch.linalg.eigh(m) for m in mats])
    if args.device == 'cuda':
        for workers in (2, 4):
            streams = [torch.cuda.Stream() for _ in range(workers)]
            # Largest first, each to the least loaded worker by d^3.
            order = sorted(range(len(mats)), key=lambda i: -widths[i])
            shares: list[list[int]] = [[] for _ in range(workers)]
            load = [0.0] * workers
            for i in order:
                w = load.index(min(load))
                shares[w].append(i)
                load[w] += widths[i] ** 3

            def run(w: int) -> None:
                with torch.cuda.stream(streams[w]):
                    for i in shares[w]:
                        torch.linalg.eigh(mats[i])

            def threaded() -> None:
                current = torch.cuda.current_stream()
                for s in streams:
                    s.wait_stream(current)
                threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                for s in streams:
                    current.wait_stream(s)

            out[f'{workers}_threads_streams'] = timer(threaded)
    by_width: dict[int, list[torch.Tensor]] = {}
    for d, m in zip(widths, mats):
        by_width.setdefault(d, []).append(m)
    stacks = [torch.stack(ms) for ms in by_width.values()]
    out['batched_by_width'] = timer(lambda: [torch.linalg.eigh(s) for s in stacks])
    print('one layer\'s eighs: ' + ', '.join(f"{k} {v['median_ms']:.1f} ms" for k, v in out.items()
                                            if isinstance(v, dict)), flush=True)
    return out


def gemm_alignment(args: argparse.Namespace, timer: Timer, pairs: list[tuple[int, int, int]]) -> dict[str, Any]:
    """Q_G^T grad Q_A for grad [g, a]: two products, 2 g a (g + a) FLOPs."""
    out: dict[str, Any] = {}
    for g, a, rows in pairs:
        qg, qa, grad = (torch.randn(g, g, device=args.device), torch.randn(a, a, device=args.device),
                        torch.randn(g, a, device=args.device))
        t = timer(lambda: qg.t().mm(grad).mm(qa))
        flops = 2 * g * a * (g + a)
        out[f'{g}x{a}'] = dict(t, tflops=flops / (t['median_ms'] / 1000) / 1e12)
        g8, a8 = -(-g // 8) * 8, -(-a // 8) * 8
        if (g8, a8) != (g, a):  # the ways to align an odd width (issue 44), each as TFLOP/s of the same 2 g a (g + a)
            def strided(rows: int, cols: int, stride: int) -> torch.Tensor:  # rows x cols, leading dimension stride
                return torch.randn(rows, stride, device=args.device)[:, :cols]
            sqg, sqa, sgrad = strided(g, g, g8), strided(a, a, a8), strided(g, a, a8)
            pqg, pqa, pgrad = (torch.randn(g8, g8, device=args.device), torch.randn(a8, a8, device=args.device),
                               torch.randn(g8, a8, device=args.device))
            pad = torch.nn.functional.pad
            ways = {'leading_dimension_padded': lambda: sqg.t().mm(sgrad).mm(sqa),
                    'held_padded': lambda: pqg.t().mm(pgrad).mm(pqa),
                    'padded_each_call': lambda: pad(qg, (0, g8 - g, 0, g8 - g)).t().mm(
                        pad(grad, (0, a8 - a, 0, g8 - g))).mm(pad(qa, (0, a8 - a, 0, a8 - a)))}
            for way, fn in ways.items():
                w = timer(fn)
                out[f'{g}x{a}'][way] = dict(w, tflops=flops / (w['median_ms'] / 1000) / 1e12)
            print(f"GEMM g {g} a {a} aligned to {g8} x {a8}: " + ', '.join(
                f"{way} {out[f'{g}x{a}'][way]['tflops']:.1f}" for way in ways) + ' TFLOP/s', flush=True)
        x = torch.randn(rows, a, device=args.device)
        full = timer(lambda: torch.mm(x.t(), x))
        # dkfac's CPU triangle (math/gemm.cpp): 4 row blocks of equal work over the upper triangle, then mirrored.
        starts = [round(a * (1 - (1 - b / 4) ** 0.5)) for b in range(4)] + [a]
        out_t = torch.empty(a, a, device=args.device)

        def triangle() -> None:
            for s, e in zip(starts, starts[1:]):
                torch.mm(x[:, s:e].t(), x[:, s:], out=out_t[s:e, s:])
            out_t.copy_(out_t.triu() + out_t.triu(1).t())

        tri = timer(triangle)
        flops = 2 * rows * a * a
        out[f'gram_{rows}x{a}'] = {'full_mm': dict(full, tflops=flops / (full['median_ms'] / 1000) / 1e12),
                                   'triangle_blocks': tri}
        print(f"GEMM g {g} a {a}: {out[f'{g}x{a}']['tflops']:.1f} TFLOP/s; gram {rows}x{a}: full mm "
              f"{full['median_ms']:.3f} ms ({flops / (full['median_ms'] / 1000) / 1e12:.1f} TFLOP/s), triangle in "
              f"blocks {tri['median_ms']:.3f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    timer = Timer(args.device, args.repeats)
    env = {'torch': torch.__version__, 'device': args.device, 'repeats': args.repeats, 'cores': os.cpu_count(),
           'threads': torch.get_num_threads()}
    if args.device == 'cuda':
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, cuda=torch.version.cuda)
    print('kernel_probe: ' + json.dumps(env), flush=True)
    if args.quick:
        sizes, layer, pairs = [32, 33, 64], [33] * 4 + [64, 65], [(32, 33, 64), (32, 32, 64)]
    else:
        sizes = [576, 1024, 1025, 2304, 4096, 4097, 4608]
        layer = [1025] * 5 + [1024] * 5 + [4096, 4097]
        pairs = [(1024, 1025, 4096), (1024, 1024, 4096), (4096, 1025, 4096), (4096, 1024, 4096),
                 (1024, 4097, 4096), (1024, 4096, 4096)]
    sizes = args.sizes or sizes
    started = time.perf_counter()
    results: dict[str, Any] = {'environment': env}

    def save() -> None:
        if args.json:
            python_step.dump_json(args.json, results)

    for name, probe in (('gemm', lambda: gemm_alignment(args, timer, pairs)),
                        ('refresh', lambda: refresh_vs_eigh(args, timer, sizes)),
                        ('one_layer_eigh', lambda: concurrent_eigh(args, timer, layer)),
                        ('eigh', lambda: eigh_backends(args, timer, sizes))):
        if args.probe and name not in args.probe:
            continue
        if time.perf_counter() - started > args.budget_s:
            results[name] = {'skipped': f'budget {args.budget_s} s spent'}
            continue
        try:
            results[name] = probe()
        except Exception as error:  # noqa: BLE001 -- reported; the other probes still run
            results[name] = {'error': f'{type(error).__name__}: {error}'}
            print(f'{name}: {type(error).__name__}: {error}', file=sys.stderr, flush=True)
        save()
    results['wall_s'] = round(time.perf_counter() - started, 1)
    save()


if __name__ == '__main__':
    main()
