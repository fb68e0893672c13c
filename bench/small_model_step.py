"""The step of a small GPT-2 with K-FAC against AdamW's, by kind of step, and against its floor (issue 45, item 4).

AdamW, K-FAC + AdamW (``dkfac.optim.KFAC``) and Adam in the K-FAC eigenbasis (``eigen_adam=True``) train copies of
one model in lockstep in this process (one step of each in turn, the order rotating), on the same batches, so that
the machine's load falls on each alike. Each step (forward, backward, optimizer step) is timed and filed by the kind
the preconditioner gave it: non-update (preconditioning only), factor (factors built in the passes and folded), or
inverse (and second order). Prints, per method and kind, the median and p90 and their count, the amortised step at
(factor_update_steps, inv_update_steps) composed from the medians, and its ratio to AdamW's; then the floor of what
K-FAC adds: the preconditioning products (4 g a (g + a) FLOPs a layer, eigen method), the factor grams
(2 rows (a^2 + g^2), half with triangles) at the sgemm rate measured here on the same shapes.

    PYTHONPATH=build/python .venv/bin/python bench/small_model_step.py                      # the 0.17M GPT-2
    PYTHONPATH=build/python .venv/bin/python bench/small_model_step.py --n-embd 128 --n-layer 4   # 0.84M
    ... --n-embd 128 --n-layer 6 --eigen-adam-diagonal-factor-dim 256   # 1.2M, eigen_adam one side unrotated
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

try:
    import dkfac
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'build' / 'python'))
    import dkfac
import dkfac.optim  # noqa: E402


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=args.context, n_embd=args.n_embd,
                                     n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    return model


def adamw(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': plain, 'weight_decay': 0.0}],
                             lr=args.lr, betas=(0.9, 0.95))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sgemm_rate(m: int, k: int, n: int, repeats: int = 20) -> float:
    """FLOP/s of one float32 m x k by k x n product here (the best of `repeats`)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = float('inf')
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--n-embd', type=int, default=64)
    parser.add_argument('--n-layer', type=int, default=3)
    parser.add_argument('--n-head', type=int, default=4)
    parser.add_argument('--context', type=int, default=128)
    parser.add_argument('--batch', type=int, default=16)
    parser.add_argument('--steps', type=int, default=400, help='timed steps of each method, after --warmup')
    parser.add_argument('--warmup', type=int, default=20)
    parser.add_argument('--factor-update-steps', type=int, default=10)
    parser.add_argument('--inv-update-steps', type=int, default=100)
    parser.add_argument('--lr', type=float, default=4e-3)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--eigen-adam-diagonal-factor-dim', type=int, default=None,
                        help="eigen_adam's diagonal_factor_dim: factors wider than this are kept diagonal, so Adam "
                             "runs unrotated on that side (default: the preconditioner's)")
    parser.add_argument('--profile', type=int, default=0,
                        help="then profile this many non-update preconditioner.step() calls of --profile-method "
                             "(torch.profiler's operators by self time)")
    parser.add_argument('--profile-method', choices=('kfac_adamw', 'eigen_adam'), default='kfac_adamw')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    methods = {'adamw': (build(args), None)}
    for name, eigen in (('kfac_adamw', False), ('eigen_adam', True)):
        model = build(args)
        methods[name] = (model, dkfac.optim.KFAC(
            model, adamw(model, args), factor_update_steps=args.factor_update_steps,
            inv_update_steps=args.inv_update_steps, damping=0.003, kl_clip=0.0 if eigen else 0.001,
            eigen_adam=eigen,
            **({'diagonal_factor_dim': args.eigen_adam_diagonal_factor_dim}
               if eigen and args.eigen_adam_diagonal_factor_dim is not None else {})))
    optimizers = {name: opt if opt is not None else adamw(model, args) for name, (model, opt) in methods.items()}
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(256, (args.batch, args.context + 1), generator=generator) for _ in range(16)]
    times: dict[str, dict[str, list[float]]] = {name: {'non-update': [], 'factor': [], 'inverse': []}
                                                for name in methods}
    order = list(methods)
    for step in range(args.warmup + args.steps):
        tokens = batches[step % len(batches)]
        for name in order:
            model, optimizer = methods[name][0], optimizers[name]
            pre = getattr(optimizer, 'preconditioner', None)
            kfac_step = pre.steps if pre is not None else step
            kind = ('inverse' if kfac_step % args.inv_update_steps == 0 else
                    'factor' if kfac_step % args.factor_update_steps == 0 else 'non-update')
            start = time.perf_counter()
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seconds = time.perf_counter() - start
            if step >= args.warmup:
                times[name][kind].append(seconds)
        order = order[1:] + order[:1]

    cpu = next((line.split(':', 1)[1].strip() for line in open('/proc/cpuinfo') if line.startswith('model name')),
               platform.processor()) if os.path.exists('/proc/cpuinfo') else platform.processor()
    params = sum(p.numel() for p in methods['adamw'][0].parameters())
    print(f'machine: {cpu}, {os.cpu_count()} cores, {args.threads} torch thread(s), load average '
          f'{os.getloadavg()[0]:.2f}; torch {torch.__version__}, transformers {transformers.__version__}, '
          f'dkfac {getattr(dkfac, "__version__", "?")}, Python {platform.python_version()}')
    print(f'model: GPT-2 n_embd {args.n_embd}, n_layer {args.n_layer}, n_head {args.n_head}, {params:,} parameters; '
          f'batch {args.batch} x {args.context} tokens; '
          f'K-FAC at ({args.factor_update_steps}, {args.inv_update_steps}); '
          + (f'eigen_adam with diagonal_factor_dim {args.eigen_adam_diagonal_factor_dim}; '
             if args.eigen_adam_diagonal_factor_dim is not None else '') +
          f'{args.steps} timed steps of each method in lockstep after {args.warmup}')
    every = args.inv_update_steps
    share = {'inverse': 1, 'factor': every // args.factor_update_steps - 1}
    share['non-update'] = every - share['inverse'] - share['factor']
    medians = {}
    print(f"\n{'method':<12} {'kind':<11} {'n':>4} {'median ms':>10} {'p90 ms':>8}")
    for name, kinds in times.items():
        for kind, values in kinds.items():
            if values:
                print(f'{name:<12} {kind:<11} {len(values):>4} {1e3 * statistics.median(values):>10.2f} '
                      f'{1e3 * percentile(values, 0.9):>8.2f}')
        pooled = [v for values in kinds.values() for v in values]
        medians[name] = {kind: statistics.median(values or pooled) for kind, values in kinds.items()}
    base = statistics.median([v for values in times['adamw'].values() for v in values])
    print(f'\namortised step over {every} steps ({share["non-update"]} non-update, {share["factor"]} factor, '
          f'1 inverse), from the medians; AdamW {1e3 * base:.2f} ms')
    for name in ('kfac_adamw', 'eigen_adam'):
        amortised = sum(share[kind] * medians[name][kind] for kind in share) / every
        print(f'  {name:<11} {1e3 * amortised:7.2f} ms, {amortised / base:.3f}x AdamW (non-update step '
              f'{medians[name]["non-update"] / base:.3f}x)')

    # The floor of what K-FAC adds: its products at this machine's sgemm rate on the layers' own shapes.
    pre = optimizers['eigen_adam'].preconditioner
    dims = pre._core.layer_dims()  # (a, g, a diagonal, g diagonal) per layer
    rows = args.batch * args.context
    precondition = factor = precondition_s = factor_s = 0.0
    for a, g, a_diagonal, g_diagonal in dims:
        flops = 2.0 * g * a * ((0 if g_diagonal else g) + (0 if a_diagonal else a)) * 2
        precondition += flops
        if not g_diagonal:
            precondition_s += 4.0 * g * g * a / sgemm_rate(g, g, a)
        if not a_diagonal:
            precondition_s += 4.0 * g * a * a / sgemm_rate(g, a, a)
        for n, diagonal in ((a, a_diagonal), (g, g_diagonal)):
            if not diagonal:
                factor += 2.0 * rows * n * n
                factor_s += 2.0 * rows * n * n / sgemm_rate(n, rows, n)
    diagonal = (f' (diagonal_factor_dim {args.eigen_adam_diagonal_factor_dim})'
                if args.eigen_adam_diagonal_factor_dim is not None else '')
    print(f'\nfloor, eigen_adam\'s {len(dims)} K-FAC layers{diagonal}, {rows} rows a pass: preconditioning '
          f'{precondition / 1e6:.1f} MFLOP a step, {1e3 * precondition_s:.2f} ms at the sgemm rates of its shapes '
          f'here; factor grams {factor / 1e6:.1f} MFLOP a factor step as full products ({1e3 * factor_s:.2f} ms; a '
          f'triangle does half), {1e3 * factor_s / args.factor_update_steps:.2f} ms a step amortised')
    floor = (precondition_s + factor_s / 2 / args.factor_update_steps) / base
    print(f'  so K-FAC adds at least {floor:.3f} of an AdamW step here, amortised (preconditioning every step, '
          'triangle grams on factor steps): the least ratio exact K-FAC can reach is '
          f'{1 + floor:.3f}x')


    if args.profile:
        name = args.profile_method
        profile_non_update_steps(methods[name][0], optimizers[name], batches[0], args)


def profile_non_update_steps(model: torch.nn.Module, optimizer, tokens: torch.Tensor, args) -> None:
    """torch.profiler over `args.profile` non-update preconditioner.step() calls on one backward's gradients (each
    marked new between calls, so that step() runs again)."""
    from torch.profiler import ProfilerActivity, profile

    pre = optimizer.preconditioner
    while True:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if pre.steps % args.factor_update_steps and pre.steps % args.inv_update_steps:
            break
        optimizer.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile):
            pre.step()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0)  # a new version of each gradient
    print(f'\n{args.profile_method}, {args.profile} non-update preconditioner.step() calls:')
    print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=12))


if __name__ == '__main__':
    main()
