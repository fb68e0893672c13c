"""dkfac: distributed K-FAC on a C++ core, with kfac_pytorch's Python API.

Switch a kfac_pytorch script by changing its import (``import dkfac as kfac`` works too)::

    import dkfac
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100)
"""

from __future__ import annotations

import torch  # first: the extension binds to the LibTorch that Python's torch loaded

from dkfac import _build_info

# The extension is built against one LibTorch; another torch's libraries have other symbols and layouts.
if torch.__version__ != _build_info.torch_version:
    raise ImportError(
        f'dkfac was built against torch {_build_info.torch_version}, but this Python has torch '
        f'{torch.__version__} ({torch.__file__}). Rebuild dkfac in this environment: pip install . '
        '(or ./scripts/build.sh with this interpreter).')

try:
    from dkfac import _C
except ImportError as error:
    raise ImportError(
        f'dkfac: its C++ extension does not load into this Python ({error}); it was built for Python '
        f'{_build_info.python_version} and torch {_build_info.torch_version}, and this is torch {torch.__version__} '
        f'from {torch.__file__}. Rebuild dkfac in this environment: pip install .') from error

from dkfac import base_preconditioner  # noqa: E402
from dkfac import callbacks  # noqa: E402
from dkfac import enums  # noqa: E402
from dkfac import hyperparams  # noqa: E402
from dkfac import optim  # noqa: E402
from dkfac import preconditioner  # noqa: E402
from dkfac import scheduler  # noqa: E402
from dkfac.base_preconditioner import BaseKFACPreconditioner  # noqa: E402
from dkfac.enums import AssignmentStrategy  # noqa: E402
from dkfac.enums import ComputeMethod  # noqa: E402
from dkfac.enums import DistributedStrategy  # noqa: E402
from dkfac.preconditioner import KFACPreconditioner  # noqa: E402
from dkfac.scheduler import LambdaParamScheduler  # noqa: E402

__version__ = _C.__version__


def configure_allocator() -> str:
    """Keeps freed memory in the process instead of returning it to the system after every step.

    With glibc's defaults every block above the mmap threshold (at most 32 MiB) is mapped and unmapped each
    time, and refilling it costs page faults every step. This turns mmap off for the heap and trims it only
    beyond 1 GiB free. It is process-wide: call it once at start-up. Returns a one-line description.
    """
    return _C.configure_allocator()


__all__ = [
    'AssignmentStrategy', 'BaseKFACPreconditioner', 'ComputeMethod', 'DistributedStrategy', 'KFACPreconditioner',
    'LambdaParamScheduler', 'base_preconditioner', 'callbacks', 'configure_allocator', 'enums', 'hyperparams', 'optim',
    'preconditioner',
    'scheduler', '__version__',
]
