#!/usr/bin/env python3
"""Allreduce latency with the ranks idle and with every rank computing (docs/STRATEGIES.md, "Rates").

Each process times Gloo allreduces of 4 B, 1 MB and 4.8 MB (median of 30, a barrier before each), first
idle, then while a thread of its own multiplies 256 x 256 matrices. Where ranks outnumber the cores, a
collective waits for its peers' transport threads to be scheduled between their compute; this is the
effect `Rates::allreduce_busy` measures in-process.

    .venv/bin/torchrun --nproc_per_node 4 bench/busy_allreduce.py
"""
import os
import platform
import statistics
import threading
import time

import torch
import torch.distributed as dist


def median_seconds(elements, repeats=30):
    t = torch.zeros(elements)
    runs = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"# torch {torch.__version__}; {platform.platform()}; {os.cpu_count()} cores; {world} processes, "
              f"1 intra-op thread each; Gloo on loopback; median of 30 allreduces per size")
    for elements in (1, 250_000, 1_200_000):
        idle = median_seconds(elements)
        stop = threading.Event()

        def compute():
            a = torch.randn(256, 256)
            while not stop.is_set():
                a @ a

        worker = threading.Thread(target=compute)
        worker.start()
        time.sleep(0.2)
        busy = median_seconds(elements)
        stop.set()
        worker.join()
        if rank == 0:
            print(f"{4 * elements:>9} B: idle {1e3 * idle:7.2f} ms, every rank computing {1e3 * busy:7.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
