#!/usr/bin/env python3
"""Per-rank K-FAC memory of a GPT-2-shaped model under DDP, FSDP2 (replicated and owner placement) and HSDP, at 1, 2
and 4 ranks (Gloo, CPU), against the plan's prediction and the owner placement's goal of 1.2/P of one process.

  .venv/bin/python bench/sharded_memory.py [--layers 8 --width 256 --steps 3]

Without torchrun's environment it launches itself under torchrun once per configuration and prints the table;
each worker builds the model from a transformers GPT2Config (nothing downloaded), trains --steps steps with the
same global batch, and reports per rank:
- state: K-FAC state held between steps (memory_usage()'s total minus the captured batches): factors, second order;
- peak: the largest memory_usage() total seen, taken just before each step() (state plus the captured batches,
  which every rank holds for every layer until step() reduces them);
- predicted: strategy::predict's memory for this rank (predicted_memory_bytes), which counts the state.
Numbers: docs/STRATEGIES.md, "Sharded models"; outputs in docs/perf/.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
MiB = 1 << 20

# (name, ranks, how the model is wrapped, preconditioner options)
CONFIGS = [
    ('one process', 1, 'none', dict(strategy='kaisa')),
    ('DDP kaisa f=1 (comm-opt)', 2, 'ddp', dict(strategy='kaisa', grad_worker_fraction=1.0)),
    ('DDP kaisa f=1/P (mem-opt)', 2, 'ddp', dict(strategy='kaisa', grad_worker_fraction=0.0)),
    ('FSDP replicated, kaisa f=1/P', 2, 'fsdp', dict(strategy='kaisa', grad_worker_fraction=0.0)),
    ('FSDP owner, kaisa', 2, 'fsdp', dict(strategy='kaisa', sharded_placement='owner')),
    ('DDP kaisa f=1 (comm-opt)', 4, 'ddp', dict(strategy='kaisa', grad_worker_fraction=1.0)),
    ('DDP kaisa f=1/P (mem-opt)', 4, 'ddp', dict(strategy='kaisa', grad_worker_fraction=0.0)),
    ('FSDP replicated, kaisa f=1/P', 4, 'fsdp', dict(strategy='kaisa', grad_worker_fraction=0.0)),
    ('FSDP owner, kaisa', 4, 'fsdp', dict(strategy='kaisa', sharded_placement='owner')),
    ('FSDP owner, dp', 4, 'fsdp', dict(strategy='dp', sharded_placement='owner')),
    ('HSDP 2x2 owner, kaisa', 4, 'hsdp', dict(strategy='kaisa', sharded_placement='owner')),
]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--layers', type=int, default=8, help='GPT-2 blocks')
    p.add_argument('--width', type=int, default=256, help='n_embd')
    p.add_argument('--vocab', type=int, default=1000)
    p.add_argument('--seq', type=int, default=32)
    p.add_argument('--batch', type=int, default=8, help='global batch (sequences)')
    p.add_argument('--steps', type=int, default=3)
    p.add_argument('--worker', help=argparse.SUPPRESS)  # JSON: (wrap, options, output path)
    return p.parse_args()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    sys.path.insert(0, str(REPO / 'build' / 'python'))
    import dkfac

    wrap, options, output = json.loads(args.worker)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    distributed = wrap != 'none'
    if distributed:
        dist.init_process_group('gloo')
    rank, size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width,
                                     n_layer=args.layers, n_head=4, tie_word_embeddings=False,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    if wrap == 'ddp':
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif wrap in ('fsdp', 'hsdp'):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape, names = ((size,), ('shard',)) if wrap == 'fsdp' else ((2, size // 2), ('replicate', 'shard'))
        mesh = init_device_mesh('cpu', shape, mesh_dim_names=names)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    preconditioner = dkfac.KFACPreconditioner(model, diagonal_factor_dim=512, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    per_rank = args.batch // size
    state, peak = 0, 0
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        optimizer.zero_grad()
        model(input_ids=mine, labels=mine).loss.backward()
        peak = max(peak, preconditioner.memory_usage()['total'])
        preconditioner.step()
        optimizer.step()
        usage = preconditioner.memory_usage()
        state = usage['total'] - usage['a_batch'] - usage['g_batch']
        peak = max(peak, usage['total'])
    element = 4  # float32 factors and second-order state
    predicted = preconditioner._core.predicted_memory_bytes(element)[rank]
    pathlib.Path(output.format(rank=rank)).write_text(json.dumps(
        {'rank': rank, 'state': state, 'peak': peak, 'predicted': predicted,
         'layers': len(preconditioner.layers)}))
    if distributed:
        dist.destroy_process_group()


def launch(args: argparse.Namespace, ranks: int, wrap: str, options: dict, scratch: pathlib.Path) -> list[dict]:
    output = str(scratch / f'{wrap}-{ranks}-{len(list(scratch.iterdir()))}-{{rank}}.json')
    forwarded = ['--layers', str(args.layers), '--width', str(args.width), '--vocab', str(args.vocab), '--seq',
                 str(args.seq), '--batch', str(args.batch), '--steps', str(args.steps),
                 '--worker', json.dumps([wrap, options, output])]
    if wrap == 'none':
        command = [sys.executable, __file__, *forwarded]
    else:
        command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc-per-node={ranks}',
                   __file__, *forwarded]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}
    subprocess.run(command, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return [json.loads(pathlib.Path(output.format(rank=r)).read_text()) for r in range(ranks)]


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    import torch
    import transformers

    print(f'# sharded K-FAC memory: GPT-2 shape, {args.layers} blocks, n_embd {args.width}, vocabulary {args.vocab}, '
          f'{args.seq} tokens, global batch {args.batch}, {args.steps} steps; CPU, Gloo, float32')
    print(f'# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}, '
          f'torch {torch.__version__}, transformers {transformers.__version__}; 1 intra-op thread per rank')
    single = None
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, ranks, wrap, options in CONFIGS:
            results = launch(args, ranks, wrap, options, pathlib.Path(scratch))
            states = [r['state'] for r in results]
            if single is None:
                single = states[0]
            rows.append({'config': name, 'ranks': ranks, 'layers': results[0]['layers'],
                         'state_max': max(states), 'state_median': statistics.median(states),
                         'state_sum': sum(states), 'peak_max': max(r['peak'] for r in results),
                         'predicted_max': max(r['predicted'] for r in results),
                         'predicted_matches': all(r['predicted'] == r['state'] for r in results),
                         'state_max_over_single': max(states) / single,
                         'goal_1_2_over_p': 1.2 / ranks})
    print(f"{'configuration':32} {'P':>2} {'state max':>10} {'median':>10} {'peak max':>10} {'predicted':>10} "
          f"{'= state':>7} {'max/1p':>7} {'1.2/P':>6}")
    for r in rows:
        print(f"{r['config']:32} {r['ranks']:>2} {r['state_max'] / MiB:>8.2f}Mi {r['state_median'] / MiB:>8.2f}Mi "
              f"{r['peak_max'] / MiB:>8.2f}Mi {r['predicted_max'] / MiB:>8.2f}Mi {str(r['predicted_matches']):>7} "
              f"{r['state_max_over_single']:>7.3f} {r['goal_1_2_over_p']:>6.3f}")
    print(json.dumps(rows))


if __name__ == '__main__':
    main()
