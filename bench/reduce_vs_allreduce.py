"""The collective owner placement's factors take (a reduce to each layer's owner) against the one they took before
(an allreduce onto every rank), on torch.distributed's Gloo, the ranks processes of this machine.

Each repeat runs both on the same buffers, in turn (the order alternating), every rank timing the collective from a
barrier to its end; a repeat's time is the slowest rank's. The reduce's root moves round the ranks, as owners do.
Prints the median and p90 of each, their ratio, and what a ring would move per rank (allreduce 2 (P-1)/P bytes,
reduce (P-1)/P), with the machine, threads and versions.

    .venv/bin/python bench/reduce_vs_allreduce.py --nproc 4 --mib 4 16 64 --repeats 30
"""
import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def timed(op):
    dist.barrier()
    start = time.perf_counter()
    op()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def worker(rank, args, port):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=args.nproc)
    rows = []
    for mib in args.mib:
        buffer = torch.rand(mib * 2 ** 20 // 4, generator=torch.Generator().manual_seed(rank))
        times = {'allreduce': [], 'reduce': []}
        for repeat in range(args.warmup + args.repeats):
            ops = [('allreduce', lambda: dist.all_reduce(buffer)),
                   ('reduce', lambda r=repeat: dist.reduce(buffer, dst=r % args.nproc))]
            for name, op in (ops if repeat % 2 == 0 else ops[::-1]):
                seconds = timed(op)
                if repeat >= args.warmup:
                    times[name].append(seconds)
        rows.append((mib, times))
    if rank == 0:
        print(f'machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores; '
              f'torch {torch.__version__}, Gloo over the loopback, {args.nproc} processes of 1 thread; '
              f'{args.repeats} repeats after {args.warmup}')
        print(f'{"MiB":>5} {"allreduce median":>17} {"p90":>8} {"reduce median":>14} {"p90":>8} {"ratio":>6}'
              f' {"ring bytes/rank: allreduce":>27} {"reduce":>7}')
        p = args.nproc
        for mib, times in rows:
            a, r = statistics.median(times['allreduce']), statistics.median(times['reduce'])
            print(f'{mib:>5} {a * 1e3:>14.2f} ms {percentile(times["allreduce"], 0.9) * 1e3:>5.2f} ms '
                  f'{r * 1e3:>11.2f} ms {percentile(times["reduce"], 0.9) * 1e3:>5.2f} ms {r / a:>6.2f}'
                  f' {2 * (p - 1) / p * mib:>23.1f} MiB {(p - 1) / p * mib:>3.1f} MiB')
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--nproc', type=int, default=4)
    parser.add_argument('--mib', type=int, nargs='+', default=[4, 16, 64])
    parser.add_argument('--repeats', type=int, default=30)
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--port', type=int, default=29611)
    args = parser.parse_args()
    mp.spawn(worker, args=(args, args.port), nprocs=args.nproc)


if __name__ == '__main__':
    main()
