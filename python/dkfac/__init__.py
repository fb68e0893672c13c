"""dkfac: distributed K-FAC on a C++ core, with kfac_pytorch's Python API.

Switch a kfac_pytorch script by changing its import (``import dkfac as kfac`` works too)::

    import dkfac
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100)
"""

from __future__ import annotations

import os

import torch  # first: the extension must bind to the LibTorch that Python's torch loaded


def _loaded_libtorch() -> set[str]:
    """Real paths of the libtorch_cpu libraries mapped into this process (empty where /proc is absent)."""
    try:
        with open('/proc/self/maps') as maps:
            return {os.path.realpath(line.split()[-1]) for line in maps
                    if 'libtorch_cpu' in line and line.split()[-1].startswith('/')}
    except OSError:
        return set()


_before = _loaded_libtorch()
try:
    from dkfac import _C
except ImportError as error:
    raise ImportError(
        f'dkfac: its C++ extension does not load into this Python ({error}). It is built against Debian\'s '
        f'LibTorch for /usr/bin/python3; Python\'s torch here is {torch.__version__} from {torch.__file__}, '
        f'loading {sorted(_before) or "an unknown libtorch_cpu"}. Use the interpreter the build named, or '
        'rebuild for this one with -DDKFAC_PYTHON=<path>.') from error
_expected = os.path.realpath(_C.torch_library)
_after = _loaded_libtorch()
if _after and _after != {_expected}:
    raise ImportError(
        f'dkfac was built against {_expected}, but Python\'s torch ({torch.__version__}, {torch.__file__}) '
        f'loaded {sorted(_before)}; both must be the same LibTorch. Use the interpreter the build named '
        '(Debian\'s /usr/bin/python3 with python3-torch) or rebuild dkfac against this torch.')

from dkfac import enums  # noqa: E402
from dkfac import hyperparams  # noqa: E402
from dkfac import preconditioner  # noqa: E402
from dkfac import scheduler  # noqa: E402
from dkfac.enums import AssignmentStrategy  # noqa: E402
from dkfac.enums import ComputeMethod  # noqa: E402
from dkfac.enums import DistributedStrategy  # noqa: E402
from dkfac.preconditioner import KFACPreconditioner  # noqa: E402
from dkfac.scheduler import LambdaParamScheduler  # noqa: E402

__version__ = _C.__version__

__all__ = [
    'AssignmentStrategy', 'ComputeMethod', 'DistributedStrategy', 'KFACPreconditioner', 'LambdaParamScheduler',
    'enums', 'hyperparams', 'preconditioner', 'scheduler', '__version__',
]
