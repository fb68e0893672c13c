"""`python -m dkfac.env`: what a bug report needs, from the installed package and this Python's torch."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import dkfac
from dkfac import _build_info


def test_env_report_names_versions_build_and_backends():
    out = subprocess.run([sys.executable, '-m', 'dkfac.env'], capture_output=True, text=True, timeout=120,
                         env={**os.environ}, check=True).stdout
    lines = dict(line.split(': ', 1) for line in out.splitlines())
    assert lines['dkfac'].startswith(dkfac.__version__ + ' ('), lines['dkfac']
    assert lines['dkfac built against torch'] == torch.__version__
    assert lines['torch'].startswith(torch.__version__ + ' ('), lines['torch']
    assert lines['torch CUDA'] == (torch.version.cuda or 'none (CPU build)')
    assert lines['dkfac compiler'] == _build_info.compiler and lines['dkfac compiler'].split()[0] in ('GNU', 'Clang')
    assert lines['dkfac build type'] == _build_info.build_type
    assert lines['dkfac NCCL backend'].startswith('compiled in' if _build_info.nccl_backend else 'not compiled in')
    assert 'gloo' in lines['process-group backends'].split(', ')
    assert lines['GPUs'].startswith(str(torch.cuda.device_count() if torch.cuda.is_available() else 0))
