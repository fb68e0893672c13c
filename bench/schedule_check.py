#!/usr/bin/env python3
"""The cost of the ranks' per-step schedule check, beside the K-FAC step it guards.

With several ranks, every ``KFACPreconditioner.step()`` first gathers seven numbers from every rank (the values of
lr, damping, kl_clip, factor_decay and the two intervals at this step, and the factor interval at the next) and refuses to go on where they differ
(docs/RELIABILITY.md): a user's schedule is a callable, which cannot be compared at construction. That is one
small collective per step, on every step, including those that move nothing else.

This benchmark runs under torchrun (Gloo on the CPU), a DDP model preconditioned by dkfac, and times side by side
in one run, step after step:

* ``step()``, split into steps that only precondition (most steps, with factor/inverse intervals 10/100) and the
  others;
* the check's collective alone: an all_gather of seven float64 values over the same group plus reading them on the
  host, which is what the check adds (its comparison is seven float compares).

Before each timed call the ranks meet at a barrier, so neither figure includes another rank's lateness. Rank 0
prints medians and p90s, the check's share of a precondition-only step, and the machine, threads and versions.

    torchrun --standalone --nproc-per-node 2 bench/schedule_check.py
    torchrun --standalone --nproc-per-node 2 bench/schedule_check.py --width 1024 --layers 8 --steps 300
"""
import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

import dkfac


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--width', type=int, default=512, help='hidden width of the MLP')
    parser.add_argument('--layers', type=int, default=6, help='Linear layers of the MLP')
    parser.add_argument('--batch', type=int, default=64, help='batch per rank')
    parser.add_argument('--steps', type=int, default=200, help='timed steps')
    parser.add_argument('--warmup', type=int, default=10)
    parser.add_argument('--threads', type=int, default=1, help='torch.set_num_threads per rank')
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(args.layers - 1):
        blocks += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100, lr=0.01,
                                              damping=0.003)
    generator = torch.Generator().manual_seed(rank)

    precondition_only: list[float] = []
    other_steps: list[float] = []
    check: list[float] = []
    mine = torch.tensor([0.01, 0.003, 0.001, 0.95, 10.0, 100.0, 10.0], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    for s in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=generator)
        y = torch.randint(0, 10, (args.batch,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        kfac_step = preconditioner.steps
        dist.barrier()
        start = time.perf_counter()
        preconditioner.step()
        step_s = time.perf_counter() - start
        optimizer.step()
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather(gathered, mine)
        values = [t.tolist() for t in gathered]
        check_s = time.perf_counter() - start
        assert all(v == values[0] for v in values)
        if s < args.warmup:
            continue
        quiet = kfac_step % 10 != 0 and kfac_step % 100 != 0
        (precondition_only if quiet else other_steps).append(step_s)
        check.append(check_s)

    if rank == 0:
        def line(name: str, values: list[float]) -> str:
            return (f'{name:<34} n={len(values):4d}  median {statistics.median(values) * 1e3:9.3f} ms  '
                    f'p90 {quantile(values, 0.9) * 1e3:9.3f} ms')
        print(f'machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; device: cpu; '
              f'{world} ranks (gloo), {args.threads} thread(s) per rank')
        print(f'versions: dkfac {dkfac.__version__}, torch {torch.__version__}, python {platform.python_version()}')
        print(f'model: MLP of {args.layers} Linear layers, width {args.width}, batch {args.batch} per rank; '
              'factor/inverse intervals 10/100')
        print(line('step(), precondition only', precondition_only))
        print(line('step(), factor or inverse steps', other_steps))
        print(line('check collective (7 float64)', check))
        share = statistics.median(check) / statistics.median(precondition_only)
        print(f'check / precondition-only step (medians): {share:.3f}')
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
