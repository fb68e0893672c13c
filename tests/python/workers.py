"""Worker processes of a multi-process test: each runs `script OUTPUT KWARGS_JSON` as one rank of a job on the
loopback (MASTER_ADDR/PORT, RANK, WORLD_SIZE, one thread) and writes its result to OUTPUT with torch.save."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def start_workers(script: str, size: int, kwargs: dict, tmp_path) -> list[subprocess.Popen]:
    """`size` ranks of tests/python/`script`, each writing tmp_path/rank{r}.pt."""
    port = free_port()
    procs = []
    for rank in range(size):
        env = dict(os.environ, MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                   PYTHONPATH=os.pathsep.join([HERE] + [p for p in sys.path if p]), PYTHONWARNINGS='ignore',
                   OMP_NUM_THREADS='1')
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, script),
                                       str(tmp_path / f'rank{rank}.pt'), json.dumps(kwargs)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def outputs_of(procs: list[subprocess.Popen], seconds: float) -> list[str]:
    """Each worker's output once all have ended; fails the test (killing them) if one runs past `seconds`."""
    outputs = []
    for rank, proc in enumerate(procs):
        try:
            outputs.append(proc.communicate(timeout=seconds)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f'rank {rank} of {len(procs)} did not finish in {seconds} s')
    return outputs


def run_workers(script: str, size: int, kwargs: dict, tmp_path) -> list[dict]:
    """start_workers, each required to end well within 240 s; their results."""
    procs = start_workers(script, size, kwargs, tmp_path)
    outputs = outputs_of(procs, 240)
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f'rank {rank} failed:\n{outputs[rank]}'
    return [torch.load(tmp_path / f'rank{rank}.pt', weights_only=False) for rank in range(size)]
