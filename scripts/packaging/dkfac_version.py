"""The wheel's version: the project's (CMakeLists.txt's `project(dkfac VERSION ...)`) with a local label naming the
torch and CUDA it is built against, as torch-extension projects label theirs: 0.1.0+pt211cu130 for torch 2.11 with
CUDA 13.0, 0.1.0+pt211cpu for a CPU-only torch. A scikit-build-core metadata provider (pyproject.toml).

The torch is the one the build compiles against: that of the interpreter pip runs, found as cmake/torch.cmake finds
it (pip's build isolation hides the environment's site-packages; `-I` sees through that).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

_PROBE = 'import torch; print(torch.__version__); print(torch.version.cuda or "")'


def label(torch_version: str, cuda: str) -> str:
    """'2.11.0+cu130', '13.0' -> 'pt211cu130'; a CPU-only torch ('2.11.0+cpu', '') -> 'pt211cpu'."""
    major, minor = re.match(r'(\d+)\.(\d+)', torch_version).groups()
    device = 'cu' + cuda.replace('.', '') if cuda else 'cpu'
    return f'pt{major}{minor}{device}'


def _torch() -> tuple[str, str]:
    for flags in ([], ['-I']):
        run = subprocess.run([sys.executable, *flags, '-c', _PROBE], capture_output=True, text=True, check=False)
        if run.returncode == 0:
            lines = run.stdout.splitlines() + ['']
            return lines[0], lines[1]
    raise RuntimeError(f'dkfac: {sys.executable} cannot import torch, which dkfac is built against: install torch '
                       f'2.11 or newer into this environment first.\n{run.stderr}')


def dynamic_metadata(field: str, settings: dict[str, Any] | None = None) -> str:
    if field != 'version':
        raise RuntimeError(f'dkfac_version provides the version only, not {field!r}')
    cmake = (Path(__file__).resolve().parents[2] / 'CMakeLists.txt').read_text()
    base = re.search(r'project\(dkfac VERSION (\d+\.\d+\.\d+)', cmake).group(1)
    return f'{base}+{label(*_torch())}'
