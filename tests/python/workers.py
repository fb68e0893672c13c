"""Worker processes of a multi-process test: each runs `script OUTPUT KWARGS_JSON` as one rank of a job on the
loopback (MASTER_ADDR/PORT, RANK, WORLD_SIZE, one thread) and writes its result to OUTPUT with torch.save.

Each rank is forked from one server process per pytest run that has imported torch, torch.distributed and dkfac
once (multiprocessing's forkserver), so a rank starts in a fraction of a second instead of the 2.5-4 s a fresh
interpreter's imports take on this project's 2-core machine. The rank then runs its script as `__main__` with its
own environment, arguments and output file, as a fresh interpreter would, and at its end its garbage is collected and
its atexit functions run (weakref finalizers included), as an interpreter's shutdown would; its exit status is the
script's. The server is given the test process's sys.path, and each rank checks that the dkfac it runs is the test
process's. A rank given 'device': 'cuda' starts as a fresh interpreter, so that nothing imported before a fork can
have touched CUDA; DKFAC_TEST_FRESH_WORKERS=1 starts every rank so.
"""
from __future__ import annotations

import atexit
import gc
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import socket
import subprocess
import sys
from unittest import mock
import warnings

import pytest
import torch

import dkfac  # the test process's, which each forked rank checks its own against

HERE = os.path.dirname(os.path.abspath(__file__))
# What every worker script imports at its top: imported once, in the server the ranks are forked from.
PRELOAD = ['torch', 'torch.distributed', 'torch.distributed.fsdp', 'torch.distributed.checkpoint',
           'torch.distributed.tensor.parallel', 'torch.distributed.pipelining', 'dkfac', 'scenarios']
# The server's own environment, fixed before it imports torch: one thread, as each rank's (and, at its start, the
# test process's sys.path as its PYTHONPATH, which multiprocessing's forkserver does not apply by itself).
SERVER_ENV = {'OMP_NUM_THREADS': '1', 'PYTHONWARNINGS': 'ignore'}


def _pythonpath() -> str:
    """This directory and the test process's sys.path, as a rank's (and the server's) PYTHONPATH."""
    return os.pathsep.join([HERE] + [p for p in sys.path if p])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _run_script(script: str, argv: list[str], env: dict[str, str], log: str, dkfac_file: str) -> None:
    """In the forked rank: the script as `__main__`, with `env` as its environment and its output into `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # In the rank, this module's dkfac is the one its server imported (or, where the server could not, the rank's own).
    if os.path.realpath(dkfac.__file__) != os.path.realpath(dkfac_file):
        raise RuntimeError(f'the worker server imported dkfac from {dkfac.__file__}, the test process from '
                           f'{dkfac_file}: set PYTHONPATH as conftest.py does, or DKFAC_TEST_FRESH_WORKERS=1')
    os.environ.clear()
    os.environ.update(env)
    if env.get('PYTHONWARNINGS') == 'ignore':
        warnings.simplefilter('ignore')
    torch.set_num_threads(int(env.get('OMP_NUM_THREADS', '1')))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name='__main__')
    finally:  # what an interpreter's shutdown runs (os._exit follows in multiprocessing's child)
        gc.collect()
        atexit._run_exitfuncs()


class _Rank:
    """One forked rank, read as `subprocess.Popen` is: communicate(timeout), kill(), returncode."""

    def __init__(self, context, script: str, argv: list[str], env: dict[str, str], log: str, dkfac_file: str):
        self._log = log
        open(log, 'w').close()  # there even where the rank fails before it writes (its status says it failed)
        # Daemonic: a test that fails before it waits for its ranks leaves none running past pytest's end.
        self._process = context.Process(target=_run_script, args=(script, argv, env, log, dkfac_file), daemon=True)
        self._process.start()

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired('worker', timeout)
        with open(self._log, errors='replace') as f:
            return f.read(), None

    def kill(self) -> None:
        self._process.kill()
        self._process.join(30)


_context = None


def _forkserver():
    """The forkserver context, its server started once with SERVER_ENV and PRELOAD."""
    global _context
    if _context is None:
        context = multiprocessing.get_context('forkserver')
        context.set_forkserver_preload(PRELOAD)
        with mock.patch.dict(os.environ, SERVER_ENV, PYTHONPATH=_pythonpath()):  # the server's only
            multiprocessing.forkserver.ensure_running()
        _context = context
    return _context


def start_workers(script: str, size: int, kwargs: dict, tmp_path) -> list:
    """`size` ranks of tests/python/`script`, each writing tmp_path/rank{r}.pt (its output in rank{r}.log)."""
    port = free_port()
    fresh = os.environ.get('DKFAC_TEST_FRESH_WORKERS') == '1' or kwargs.get('device') == 'cuda'
    path = os.path.join(HERE, script)
    procs = []
    for rank in range(size):
        env = dict(os.environ, MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                   PYTHONPATH=_pythonpath(), **SERVER_ENV)
        argv = [str(tmp_path / f'rank{rank}.pt'), json.dumps(kwargs)]
        if fresh:
            procs.append(subprocess.Popen([sys.executable, path, *argv], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        else:
            procs.append(_Rank(_forkserver(), path, argv, env, str(tmp_path / f'rank{rank}.log'), dkfac.__file__))
    return procs


def outputs_of(procs: list, seconds: float) -> list[str]:
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
