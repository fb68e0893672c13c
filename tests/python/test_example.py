"""examples/fashion_mnist_resnet.py trains on the README's set-up: one process, and two workers started by
examples/launch.py (torch's elastic launcher API, as torchrun would; Debian 12's torchrun itself fails).
examples/gpt_tensor_parallel.py trains under torchrun (this environment's, `python -m torch.distributed.run`) with
FSDP2 x TP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = '/usr/share/datasets/fashion-mnist'


def run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    if not os.path.isdir(DATA):
        pytest.skip(f'{DATA} is missing: install dataset-fashion-mnist (./scripts/setup.sh)')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONWARNINGS='ignore')
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_single_process_with_dkfac():
    result = run(['examples/fashion_mnist_resnet.py', '--model', 'cnn', '--max-steps', '12',
                  '--kfac-factor-update-steps', '2', '--kfac-inv-update-steps', '4'])
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"world_size": 1' in result.stdout and '"kfac_backend": "dkfac"' in result.stdout, result.stdout


def test_two_workers_under_the_elastic_launcher():
    result = run(['examples/launch.py', '--nproc-per-node', '2', 'examples/fashion_mnist_resnet.py', '--model', 'cnn',
                  '--max-steps', '12', '--kfac-factor-update-steps', '2', '--kfac-inv-update-steps', '4',
                  '--kfac-strategy', 'hybrid-opt'])
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"world_size": 2' in result.stdout and '"kfac_backend": "dkfac"' in result.stdout, result.stdout


def test_the_gpt_trains_with_fsdp2_and_tensor_parallel_under_torchrun():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONWARNINGS='ignore')
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '4',
                             'examples/gpt_tensor_parallel.py', '--tp', '2', '--steps', '12', '--log-interval', '11',
                             '--corpus-bytes', '1000000'], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(line.split()[4]) for line in result.stdout.splitlines() if line.startswith('step')]
    assert len(losses) == 2 and losses[1] < losses[0] - 1.0, result.stdout  # from ln 256 = 5.5 towards 3
    assert 'K-FAC state on rank 0' in result.stdout and '14 layers' in result.stdout, result.stdout
