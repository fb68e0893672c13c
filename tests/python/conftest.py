"""pytest configuration: tests import `dkfac` from the build tree (PYTHONPATH=build/python) and `scenarios`."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD_PYTHON = os.environ.get('DKFAC_BUILD_PYTHON', os.path.join(ROOT, 'build', 'python'))
if os.path.isdir(BUILD_PYTHON) and BUILD_PYTHON not in sys.path:
    sys.path.insert(0, BUILD_PYTHON)


def pytest_configure(config) -> None:
    config.addinivalue_line('markers', 'gpu: needs a CUDA device (scripts/gpu_check.sh runs them); skipped, saying '
                                       'why, where none is visible')
