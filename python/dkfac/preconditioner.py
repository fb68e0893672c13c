"""KFACPreconditioner: kfac_pytorch's preconditioner API on dkfac's C++ core.

Python finds the model's ``torch.nn.Linear`` / ``torch.nn.Conv2d`` modules and chooses the distributed
placement; BaseKFACPreconditioner hooks them, and the hooks hand each layer's input and output gradient to
the core, which builds the factors, reduces them, computes the second-order state, preconditions, clips and
runs every collective (the same code as the C++ API).
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dkfac import _C
from dkfac.base_preconditioner import BaseKFACPreconditioner
from dkfac.enums import AllreduceMethod
from dkfac.enums import AssignmentStrategy
from dkfac.enums import ComputeMethod
from dkfac.enums import DistributedStrategy

_STRATEGIES = ('kaisa', 'spd', 'dp')
_DTYPES = {torch.float32: 'float32', torch.float64: 'float64', torch.bfloat16: 'bfloat16', torch.float16: 'float16'}


def _enum(value: Any, enum: type, argument: str) -> Any:
    if isinstance(value, enum):
        return value
    if isinstance(value, str) and value.upper() in enum.__members__:
        return enum[value.upper()]
    names = ', '.join(repr(n.lower()) for n in enum.__members__)
    raise ValueError(f'{argument} must be one of {names} or {enum.__name__}, got {value!r}')


def _matches(patterns: list[str], *texts: str) -> bool:
    return any(re.search(p, t) for p in patterns for t in texts)


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC gradient preconditioner, a drop-in for kfac_pytorch's ``kfac.preconditioner.KFACPreconditioner``.

    Registers every ``torch.nn.Linear`` and ``torch.nn.Conv2d`` leaf of ``model`` whose parameters all
    require grad (minus ``skip_layers``, matched against the ``named_modules()`` name and the class name),
    and at each ``step()`` replaces their gradients by the preconditioned, KL-clipped ones. Call it after
    ``loss.backward()`` (gradients already averaged, e.g. by ``DistributedDataParallel``) and before
    ``optimizer.step()``.

    kfac_pytorch's keyword arguments keep their meanings and defaults; each of ``factor_update_steps``,
    ``inv_update_steps``, ``damping``, ``factor_decay``, ``kl_clip`` and ``lr`` is a number or a callable of
    the K-FAC step. dkfac's own: ``strategy`` ('kaisa', 'spd' or 'dp'), ``unused_layer_policy`` ('error' or
    'skip'), ``pi_damping`` (inverse method), ``process_group`` (default: torch.distributed's default group
    when initialised), ``spd_redundant_dim``, ``timeout`` (seconds for dkfac's own subgroups) and
    ``large_factor_dim`` (a layer with a factor wider than this is warned about when the preconditioner is
    built, with the factor's memory and the cost of its second-order updates; 0: never).

    Warnings, the C++ core's included, go through Python's ``warnings`` module (UserWarning, attributed to
    the caller's line) and name layers by their torch.nn class; the registered layers and the step plan are
    logged through the ``dkfac`` logger at ``loglevel``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        factor_update_steps: Callable[[int], int] | int = 1,
        inv_update_steps: Callable[[int], int] | int = 1,
        damping: Callable[[int], float] | float = 0.001,
        factor_decay: Callable[[int], float] | float = 0.95,
        kl_clip: Callable[[int], float] | float | None = 0.001,
        lr: Callable[[int], float] | float = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: list[str] | str | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        strategy: str = 'kaisa',
        unused_layer_policy: str = 'error',
        pi_damping: bool = False,
        process_group: Any = None,
        spd_redundant_dim: int | None = None,
        timeout: float | None = None,
        large_factor_dim: int = 4096,
    ) -> None:
        # The hyper-parameters, accumulation_steps and loglevel are BaseKFACPreconditioner's to check.
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f'model must be a torch.nn.Module, got {type(model).__name__}')
        if not isinstance(allreduce_bucket_cap_mb, (int, float)) or allreduce_bucket_cap_mb < 0:
            raise ValueError(f'allreduce_bucket_cap_mb must be >= 0, got {allreduce_bucket_cap_mb!r}')
        assignment_strategy = _enum(assignment_strategy, AssignmentStrategy, 'assignment_strategy')
        compute_method = _enum(compute_method, ComputeMethod, 'compute_method')
        if compute_method == ComputeMethod.EIGEN and compute_eigenvalue_outer_product and not colocate_factors:
            raise ValueError('colocate_factors must be True to use compute_eigenvalue_outer_product')
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(map(repr, _STRATEGIES))}, got {strategy!r}")
        if unused_layer_policy not in ('error', 'skip'):
            raise ValueError(f"unused_layer_policy must be 'error' or 'skip', got {unused_layer_policy!r}")
        if pi_damping and compute_method != ComputeMethod.INVERSE:
            raise ValueError("pi_damping applies to compute_method='inverse' only")
        for name, dtype in (('factor_dtype', factor_dtype), ('inv_dtype', inv_dtype)):
            if dtype is not None and dtype not in _DTYPES:
                raise ValueError(f'{name} must be a floating-point torch.dtype, got {dtype!r}')
        if grad_scaler is not None and not (hasattr(grad_scaler, 'get_scale') or callable(grad_scaler)):
            raise TypeError(f'grad_scaler must have get_scale() or be a callable returning the scale, got {grad_scaler!r}')
        if isinstance(large_factor_dim, bool) or not isinstance(large_factor_dim, int) or large_factor_dim < 0:
            raise ValueError(f'large_factor_dim must be an int >= 0 (0: no warning), got {large_factor_dim!r}')
        if isinstance(skip_layers, str):
            skip_layers = [skip_layers]
        skip_layers = list(skip_layers or [])
        for pattern in skip_layers:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f'skip_layers pattern {pattern!r} is not a valid regular expression: {e}') from None

        group = process_group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        size = dist.get_world_size(group) if group is not None else 1
        grad_worker_fraction, distributed_strategy = self._resolve_fraction(grad_worker_fraction, size)
        if not colocate_factors and distributed_strategy is DistributedStrategy.MEM_OPT:
            warnings.warn('grad_worker_fraction=1/world_size (MEM_OPT) requires colocate_factors=True; enabling it',
                          stacklevel=2)
            colocate_factors = True
        if strategy != 'kaisa' and grad_worker_fraction != 1.0:
            raise ValueError(f"grad_worker_fraction applies to strategy='kaisa' only ({strategy!r} places its own "
                             f'work), got {grad_worker_fraction}')

        self.allreduce_bucket_cap_mb = allreduce_bucket_cap_mb
        self.allreduce_method = (AllreduceMethod.ALLREDUCE_BUCKETED if allreduce_bucket_cap_mb > 0
                                 else AllreduceMethod.ALLREDUCE)
        self.assignment_strategy = assignment_strategy
        self.colocate_factors = colocate_factors
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self.compute_method = compute_method
        self.distributed_strategy = distributed_strategy
        self.grad_worker_fraction = grad_worker_fraction
        self.grad_scaler = grad_scaler
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.large_factor_dim = large_factor_dim
        self.skip_layers = skip_layers
        self.symmetry_aware = symmetry_aware
        self.strategy = strategy
        self.unused_layer_policy = unused_layer_policy
        self.pi_damping = pi_damping

        layers = self._register(model)
        options = dict(
            compute_method=compute_method.name.lower(),
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            pi_damping=pi_damping,
            unused_layer_policy=unused_layer_policy,
            grad_worker_fraction=float(grad_worker_fraction),
            symmetry_aware=symmetry_aware,
            assignment_strategy=assignment_strategy.name.lower(),
            colocate_factors=colocate_factors,
            allreduce_bucket_cap_mb=float(allreduce_bucket_cap_mb),
            strategy=strategy,
            factor_dtype=None if factor_dtype is None else _DTYPES[factor_dtype],
            inv_dtype=None if inv_dtype is None else _DTYPES[inv_dtype],
            grad_scale=self._scale_function(grad_scaler),
            spd_redundant_dim=spd_redundant_dim,
            large_factor_dim=large_factor_dim,
        )
        # repr() entries beyond the base's, as kfac_pytorch lists them, then dkfac's own.
        defaults = {
            'allreduce_bucket_cap_mb': allreduce_bucket_cap_mb, 'allreduce_method': self.allreduce_method,
            'assignment_strategy': assignment_strategy, 'colocate_factors': colocate_factors,
            'compute_eigenvalue_outer_product': compute_eigenvalue_outer_product, 'compute_method': compute_method,
            'distributed_strategy': distributed_strategy, 'grad_worker_fraction': grad_worker_fraction,
            'grad_scaler': grad_scaler is not None, 'factor_dtype': factor_dtype, 'inv_dtype': inv_dtype,
            'skip_layers': skip_layers, 'symmetry_aware': symmetry_aware,
            'large_factor_dim': large_factor_dim, 'strategy': strategy, 'world_size': size,
        }
        super().__init__(
            layers, options=options, process_group=group if size > 1 else None, timeout=timeout,
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps, damping=damping,
            factor_decay=factor_decay, kl_clip=kl_clip, lr=lr, accumulation_steps=accumulation_steps,
            update_factors_in_hook=update_factors_in_hook, defaults=defaults, loglevel=loglevel)

    # --- registration --------------------------------------------------------------------------------
    def _register(self, model: torch.nn.Module) -> dict[torch.nn.Module, tuple[str, Any]]:
        """{module: (name, capture)} of the layers to precondition, in model order (hooked by the base)."""
        layers: dict[torch.nn.Module, tuple[str, Any]] = {}
        candidates: list[tuple[str, str]] = []  # (name, class name) of every layer skip_layers could match
        for name, module in model.named_modules():
            if any(True for _ in module.children()):
                continue
            if isinstance(module, torch.nn.Linear):
                capture = _C.linear_capture(module.bias is not None)
            elif isinstance(module, torch.nn.Conv2d):
                if module.groups != 1:
                    warnings.warn(f'dkfac: layer {name!r} is a grouped Conv2d (groups={module.groups}); it keeps '
                                  'its plain gradient', stacklevel=3)
                    continue
                capture = _C.conv2d_capture(
                    module.bias is not None, tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation),
                    module.padding if isinstance(module.padding, str) else tuple(module.padding),
                    module.padding_mode, tuple(module._reversed_padding_repeated_twice))
            else:
                continue
            if not all(p.requires_grad for p in module.parameters()):
                continue
            kind = type(module).__name__  # e.g. NonDynamicallyQuantizableLinear, as messages name it
            candidates.append((name, kind))
            if _matches(self.skip_layers, name, kind):
                continue
            layers[module] = (name, capture)
        for pattern in self.skip_layers:
            if not any(_matches([pattern], name, kind) for name, kind in candidates):
                names = ', '.join(f'{name!r} ({kind})' for name, kind in candidates)
                warnings.warn(f'dkfac: skip_layers pattern {pattern!r} matches no layer, so it skips nothing; '
                              f'patterns are searched (re.search) in these layer names and kinds: {names}',
                              stacklevel=3)
        if not layers:
            raise ValueError('KFACPreconditioner found no torch.nn.Linear or torch.nn.Conv2d layer to precondition in '
                             f'{type(model).__name__} (after skip_layers={self.skip_layers!r} and frozen parameters)')
        return layers

    @staticmethod
    def _resolve_fraction(fraction: Any, size: int) -> tuple[float, DistributedStrategy]:
        if isinstance(fraction, DistributedStrategy):
            value = {DistributedStrategy.COMM_OPT: 1.0, DistributedStrategy.HYBRID_OPT: 0.5,
                     DistributedStrategy.MEM_OPT: 1.0 / size}[fraction]
            if size % max(1, round(size * value)) != 0:
                raise ValueError(f'grad_worker_fraction {fraction.name} gives {round(size * value)} gradient workers, '
                                 f'which does not divide the world size {size}')
            return value, fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f'grad_worker_fraction must be in [0, 1] or a DistributedStrategy, got {fraction!r}')
        if fraction == 0:
            fraction = 1.0 / size
        if size % max(1, round(size * fraction)) != 0:
            raise ValueError(f'grad_worker_fraction {fraction} must produce groups of equal size: '
                             f'{max(1, round(size * fraction))} gradient workers do not divide {size} ranks')
        fraction = float(fraction)
        if fraction == 1.0:
            return fraction, DistributedStrategy.COMM_OPT
        if fraction <= 1 / size:
            return fraction, DistributedStrategy.MEM_OPT
        return fraction, DistributedStrategy.HYBRID_OPT

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
