"""KFACPreconditioner: kfac_pytorch's preconditioner API on dkfac's C++ core.

Python finds the model's ``torch.nn.Linear`` / ``torch.nn.Conv2d`` modules and chooses the distributed
placement; BaseKFACPreconditioner hooks them, and the hooks hand each layer's input and output gradient to
the core, which builds the factors, reduces them, computes the second-order state, preconditions, clips and
runs every collective (the same code as the C++ API).
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dkfac import _C
from dkfac.base_preconditioner import BaseKFACPreconditioner
from dkfac.base_preconditioner import _CoreWarnings
from dkfac.enums import AllreduceMethod
from dkfac.enums import AssignmentStrategy
from dkfac.enums import ComputeMethod
from dkfac.enums import DistributedStrategy

# The core's options (dkfac/options.h, each declared once): KFACPreconditioner's keywords, their defaults and
# checks come from this table. A keyword is the option's kfac_pytorch name where it has one.
_OPTIONS = {o['name']: o for o in _C.option_table()}
_KEYWORDS = {(o['alias'] or o['name']): o for o in _OPTIONS.values()}
_KEYWORDS.update({o['name']: o for o in _OPTIONS.values()})  # dkfac's own name is accepted too
# The options BaseKFACPreconditioner takes (kfac_pytorch's base class has them), and the front end's own.
_BASE = ('factor_update_steps', 'inv_update_steps', 'damping', 'factor_decay', 'kl_clip', 'lr', 'accumulation_steps',
         'update_factors_in_hook')
_FRONT_END = {'grad_scaler': None, 'loglevel': logging.DEBUG, 'process_group': None, 'timeout': None}
# kfac_pytorch's enum for an option whose values it names with one.
_ENUMS = {'compute_method': ComputeMethod, 'balance': AssignmentStrategy}


def _python_default(option: dict[str, Any]) -> Any:
    """An option's default as a kfac_pytorch user writes it: kfac_pytorch's own where it differs from dkfac's."""
    text = option['kfac_pytorch_default'] or option['default']
    kind = option['type']
    if kind == 'bool':
        return text == 'true'
    if kind == 'int':
        return int(text)
    if kind == 'float':
        return float(text)
    if kind == 'dtype':
        return None if text == 'none' else getattr(torch, text)
    if kind in ('strings', 'ints'):
        return []
    enum = _ENUMS.get(option['name'])
    return enum[text.upper()] if enum else text


def _core_value(value: Any) -> Any:
    """A keyword's value as the core takes it: kfac_pytorch's enums and torch dtypes by name."""
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, torch.dtype):
        return str(value).removeprefix('torch.')
    if isinstance(value, tuple):
        return list(value)
    return value


def _signature() -> inspect.Signature:
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter('self', inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter('model', inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(o['alias'] or o['name'], keyword, default=_python_default(o))
               for o in _OPTIONS.values()]
    params += [inspect.Parameter(name, keyword, default=value) for name, value in _FRONT_END.items()]
    return inspect.Signature(params)


def _options_doc() -> str:
    lines = []
    for o in _OPTIONS.values():
        name = o['alias'] or o['name']
        default = repr(_python_default(o))
        kinds = ' (a number or a callable of the step)' if o['schedule'] else ''
        also = f"; dkfac's name: {o['name']}" if o['alias'] else ''
        lines.append(f'    ``{name}`` (default {default}{kinds}{also}): {o["doc"]}.')
    return '\n'.join(lines)


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC gradient preconditioner, a drop-in for kfac_pytorch's ``kfac.preconditioner.KFACPreconditioner``.

    Registers every ``torch.nn.Linear`` and ``torch.nn.Conv2d`` leaf of ``model`` whose parameters all
    require grad (minus ``skip_layers``, matched against the ``named_modules()`` name and the class name),
    and at each ``step()`` replaces their gradients by the preconditioned, KL-clipped ones. Call it after
    ``loss.backward()`` (gradients already averaged, e.g. by ``DistributedDataParallel``) and before
    ``optimizer.step()``.

    kfac_pytorch's keyword arguments keep their meanings and defaults; each of ``factor_update_steps``,
    ``inv_update_steps``, ``damping``, ``factor_decay``, ``kl_clip`` and ``lr`` is a number or a callable of
    the K-FAC step. dkfac's own: ``strategy`` ('kaisa', 'spd', 'dp', or 'auto': the
    fastest of them on rates measured at the first step that fits ``memory_budget`` bytes of K-FAC state per rank,
    chosen again after ``auto_recheck_steps`` profiled steps where they measured more than 20% off the prediction;
    see ``strategy_choice``), ``unused_layer_policy`` ('error' or
    'skip'), ``pi_damping`` (inverse method), ``process_group`` (default: torch.distributed's default group
    when initialised), ``spd_redundant_dim``, ``timeout`` (seconds for dkfac's own subgroups) and
    ``large_factor_dim`` (a layer with a factor wider than this is warned about when the preconditioner is
    built, with the factor's memory and the cost of its second-order updates; 0: never).

    Warnings, the C++ core's included, go through Python's ``warnings`` module (UserWarning, attributed to
    the caller's line) and name layers by their torch.nn class; the registered layers and the step plan are
    logged through the ``dkfac`` logger at ``loglevel``.
    """

    def __init__(self, model: torch.nn.Module, **kwargs: Any) -> None:
        # The keywords are the core's options (dkfac/options.h; listed below) and the front end's own
        # (grad_scaler, loglevel, process_group, timeout); the core checks every value and names the keyword.
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f'model must be a torch.nn.Module, got {type(model).__name__}')
        for name in kwargs:
            if name not in _KEYWORDS and name not in _FRONT_END:
                raise TypeError(f'KFACPreconditioner() got an unexpected keyword argument {name!r}; its keywords are '
                                f"{', '.join(p for p in _SIGNATURE.parameters if p not in ('self', 'model'))}")
        front = {name: kwargs.pop(name, default) for name, default in _FRONT_END.items()}
        given = {_KEYWORDS[name]['name']: value for name, value in kwargs.items()}  # dkfac's names
        typed = {_KEYWORDS[name]['name']: name for name in kwargs}  # the core's messages name the keyword as typed
        values = {name: given.get(name, _python_default(o)) for name, o in _OPTIONS.items()}  # as the user sees them
        core = {name: _core_value(v) for name, v in values.items()
                if name in given or _OPTIONS[name]['kfac_pytorch_default']}
        if isinstance(core.get('skip_layers'), str):
            core['skip_layers'] = [core['skip_layers']]
        self.skip_layers = list(core.get('skip_layers', []))
        resolved = dict(_C.option_values({typed.get(k, k): v for k, v in core.items()}))  # checked by the core

        compute_method = _ENUMS['compute_method'][resolved['compute_method'].upper()]
        colocate = values['colocate_factors']
        if (compute_method == ComputeMethod.EIGEN and values['compute_eigenvalue_outer_product']
                and not colocate):  # kfac_pytorch's rule, kept for its users
            raise ValueError('colocate_factors must be True to use compute_eigenvalue_outer_product')
        grad_scaler = front['grad_scaler']
        if grad_scaler is not None and not (hasattr(grad_scaler, 'get_scale') or callable(grad_scaler)):
            raise TypeError(f'grad_scaler must have get_scale() or be a callable returning the scale, got {grad_scaler!r}')

        group = front['process_group']
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        size = dist.get_world_size(group) if group is not None else 1
        fraction = float(resolved['grad_worker_fraction'])
        workers = max(1, round(size * fraction))
        distributed_strategy = (DistributedStrategy.COMM_OPT if workers == size else
                                DistributedStrategy.MEM_OPT if workers == 1 else DistributedStrategy.HYBRID_OPT)
        if size > 1 and distributed_strategy is DistributedStrategy.MEM_OPT and not colocate:
            warnings.warn('grad_worker_fraction=1/world_size (MEM_OPT) requires colocate_factors=True; enabling it',
                          stacklevel=2)
            core['colocate_factors'] = colocate = True
        if fraction == 0:
            fraction = 1.0 / size

        # kfac_pytorch's attributes, with the values as given (or defaulted).
        for name, value in values.items():
            if name not in _BASE:
                setattr(self, _OPTIONS[name]['alias'] or name, value)
        self.colocate_factors = colocate
        self.compute_method = compute_method
        self.grad_worker_fraction = fraction
        self.distributed_strategy = distributed_strategy
        self.allreduce_method = (AllreduceMethod.ALLREDUCE_BUCKETED if values['allreduce_bucket_cap_mb'] > 0
                                 else AllreduceMethod.ALLREDUCE)
        self.grad_scaler = grad_scaler

        layers = self._register(model)
        options = {typed.get(k, k): v for k, v in core.items() if k not in _BASE}
        options['grad_scale'] = self._scale_function(grad_scaler)
        # repr(): every option (kfac_pytorch's names and values as given), then the fields kfac_pytorch derives.
        defaults = {(_OPTIONS[n]['alias'] or n): v for n, v in values.items() if n not in _BASE}
        defaults.update(allreduce_method=self.allreduce_method, colocate_factors=colocate,
                        compute_method=compute_method, distributed_strategy=distributed_strategy,
                        grad_worker_fraction=fraction, grad_scaler=grad_scaler is not None,
                        skip_layers=self.skip_layers, world_size=size)
        super().__init__(
            layers, options=options, process_group=group if size > 1 else None, timeout=front['timeout'],
            defaults=defaults, loglevel=front['loglevel'],
            **{name: values[name] for name in _BASE})

    # --- registration --------------------------------------------------------------------------------
    def _register(self, model: torch.nn.Module) -> dict[torch.nn.Module, tuple[str, Any]]:
        """{module: (name, capture)} of the layers to precondition, in model order (hooked by the base): the
        torch.nn.Linear and Conv2d leaves, chosen by the core's rules (dkfac/layers/discovery.h: frozen, grouped
        and skip_layers), the same ones the C++ front end applies, with the same warnings and errors."""
        modules, candidates = [], []
        for name, module in model.named_modules():
            if any(True for _ in module.children()) or not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                continue
            kind = 'Linear' if isinstance(module, torch.nn.Linear) else 'Conv2d'
            trainable = all(p.requires_grad for p in module.parameters())
            candidates.append((name, type(module).__name__, kind, trainable, getattr(module, 'groups', 1)))
            modules.append(module)
        with _CoreWarnings():
            chosen = _C.choose_layers(candidates, self.skip_layers, type(model).__name__)
        layers: dict[torch.nn.Module, tuple[str, Any]] = {}
        for index in chosen:
            name, module = candidates[index][0], modules[index]
            if isinstance(module, torch.nn.Linear):
                capture = _C.linear_capture(module.bias is not None)
            else:
                capture = _C.conv2d_capture(
                    module.bias is not None, tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation),
                    module.padding if isinstance(module.padding, str) else tuple(module.padding),
                    module.padding_mode, tuple(module._reversed_padding_repeated_twice))
            layers[module] = (name, capture)
        return layers

    @staticmethod
    def _scale_function(grad_scaler: Any) -> Callable[[], torch.Tensor] | None:
        """The loss scale as a one-element tensor, read at each G capture without waiting for the device:
        a ``torch.amp.GradScaler``'s own scale tensor; a number from ``get_scale()`` or a callable, checked."""
        if grad_scaler is None:
            return None
        scale_tensor = getattr(grad_scaler, '_get_scale_async', None)  # torch.amp.GradScaler (torch 2.x)
        get = grad_scaler.get_scale if hasattr(grad_scaler, 'get_scale') else grad_scaler

        def scale() -> torch.Tensor:
            if scale_tensor is not None and getattr(grad_scaler, 'is_enabled', lambda: True)():
                value = scale_tensor()
                if value is not None:  # None before the scaler's first scale(): its initial scale, below
                    return value
            value = get()
            if isinstance(value, torch.Tensor):
                return value
            value = float(value)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f'grad scaler returned {value}; the loss scale must be a positive finite number')
            return torch.tensor(value, dtype=torch.float64)

        return scale


_SIGNATURE = _signature()
KFACPreconditioner.__init__.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
KFACPreconditioner.__doc__ = (KFACPreconditioner.__doc__ or '') + '\n    Keyword arguments:\n\n' + _options_doc() + '\n'
