"""pytest configuration: tests import `dkfac` from the build tree (PYTHONPATH=build/python) and `scenarios`.

DKFAC_TEST_INSTALLED=DIR runs the suite against an installed dkfac instead (tests/integration/pip_install_test.sh:
the wheel in a fresh venv): the build tree is left off sys.path, and the run stops before any test unless the
`dkfac` it imports lies under DIR (a venv or a site-packages directory). Helpers built with the C++ library (the
C++ API's reference binary, DKFAC_CPP_REFERENCE) still come from the build tree.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ROOT = os.path.dirname(os.path.dirname(HERE))
INSTALLED = os.environ.get('DKFAC_TEST_INSTALLED')
BUILD_PYTHON = os.environ.get('DKFAC_BUILD_PYTHON', os.path.join(ROOT, 'build', 'python'))
if not INSTALLED and os.path.isdir(BUILD_PYTHON) and BUILD_PYTHON not in sys.path:
    sys.path.insert(0, BUILD_PYTHON)


def pytest_configure(config) -> None:
    config.addinivalue_line('markers', 'gpu: needs a CUDA device (scripts/gpu_check.sh runs them); skipped, saying '
                                       'why, where none is visible')
    if INSTALLED:
        try:
            import dkfac
        except ImportError as e:
            raise pytest.UsageError(f'DKFAC_TEST_INSTALLED={INSTALLED}, but dkfac does not import: {e}') from e
        where = os.path.realpath(dkfac.__file__)
        if not where.startswith(os.path.realpath(INSTALLED) + os.sep):
            raise pytest.UsageError(f'DKFAC_TEST_INSTALLED={INSTALLED}, but this Python imports dkfac from {where}')


def pytest_report_header(config) -> str:
    try:
        import dkfac
    except ImportError as e:
        return f'dkfac does not import: {e}'
    return f'dkfac {dkfac.__version__} from {os.path.dirname(dkfac.__file__)}'
