"""The package's first promise: a kfac_pytorch user's script runs with only its import changed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(source: str, pythonpath: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / 'train.py'
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONWARNINGS='ignore')
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)


def losses(output: str) -> list[float]:
    return [float(line.split()[1]) for line in output.splitlines() if line.startswith(('loss', 'eval'))]


def test_runs_with_only_the_import_changed(tmp_path):
    with open(os.path.join(HERE, 'user_script.py')) as f:
        original = f.read()
    changed = original.replace('import kfac\n', 'import dkfac as kfac\n', 1)
    changed = changed.replace('from kfac.', 'from dkfac.')
    dkfac_path = os.pathsep.join(p for p in sys.path if p)
    result = run_script(changed, dkfac_path, tmp_path)
    assert result.returncode == 0, result.stderr
    values = losses(result.stdout)
    assert len(values) == 22
    assert values[-1] < values[10], 'training lowers the evaluation loss'
    assert 'steps 20' in result.stderr and 'memory True' in result.stderr

    src = os.environ.get('KFAC_PYTORCH_SRC')
    if not src:
        pytest.skip('KFAC_PYTORCH_SRC is not set: dkfac ran; the side-by-side run needs kfac_pytorch source')
    reference = run_script(original, src + os.pathsep + dkfac_path, tmp_path)
    assert reference.returncode == 0, reference.stderr
    assert values == pytest.approx(losses(reference.stdout), rel=1e-4, abs=1e-5)
