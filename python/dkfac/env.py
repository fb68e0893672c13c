"""What a bug report needs to know about this dkfac and its environment: ``python -m dkfac.env``.

Prints dkfac's version and what it was built against (torch, CUDA, Python, compiler, build type, whether its NCCL
backend was compiled in), then what this Python has: torch, CUDA, cuDNN, NCCL, the visible GPUs and the
process-group backends torch.distributed offers. Every line is ``name: value``.
"""

from __future__ import annotations

import platform
import sys


def _torch_lines() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist
    lines = [('torch', f'{torch.__version__} ({torch.__file__})'), ('torch CUDA', torch.version.cuda or 'none (CPU build)')]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(('cuDNN', str(cudnn) if cudnn else 'none'))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ', '.join(torch.cuda.get_device_name(i) for i in range(gpus))
    lines.append(('GPUs', f'{gpus}{" (" + names + ")" if names else ""}'))
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = '.'.join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = None
    lines.append(('NCCL', nccl or 'none'))
    if dist.is_available():
        backends = [name for name, available in (('gloo', dist.is_gloo_available()), ('nccl', dist.is_nccl_available()),
                                                 ('mpi', dist.is_mpi_available())) if available]
        lines.append(('process-group backends', ', '.join(backends) or 'none'))
    else:
        lines.append(('process-group backends', 'torch.distributed is not available in this torch'))
    return lines


def report() -> list[tuple[str, str]]:
    """The report as (name, value) pairs; dkfac's own lines say why when it cannot be imported."""
    lines = [('Python', f'{platform.python_version()} ({sys.executable})'), ('platform', platform.platform())]
    try:
        from dkfac import _build_info
        lines += [('dkfac built against torch', _build_info.torch_version),
                  ('dkfac built against CUDA', _build_info.torch_cuda or 'none (CPU build of torch)'),
                  ('dkfac built for Python', _build_info.python_version),
                  ('dkfac compiler', _build_info.compiler),
                  ('dkfac build type', _build_info.build_type),
                  ('dkfac NCCL backend', 'compiled in' if _build_info.nccl_backend else 'not compiled in (CUDA tensors go through Gloo)')]
    except ImportError as error:
        lines.append(('dkfac build info', f'unavailable: {error}'))
    try:
        import dkfac
        lines.insert(0, ('dkfac', f'{dkfac.__version__} ({dkfac.__file__})'))
    except ImportError as error:
        lines.insert(0, ('dkfac', f'does not import: {error}'))
    try:
        lines += _torch_lines()
    except ImportError as error:
        lines.append(('torch', f'does not import: {error}'))
    return lines


def main() -> None:
    for name, value in report():
        print(f'{name}: {value}')


if __name__ == '__main__':
    main()
