"""KFACPreconditioner: kfac_pytorch's preconditioner API on dkfac's C++ core.

Python registers the model's ``torch.nn.Linear`` / ``torch.nn.Conv2d`` modules and hooks them; the hooks
hand each layer's input and output gradient to the core, which builds the factors, reduces them, computes
the second-order state, preconditions, clips and runs every collective (the same code as the C++ API).
"""

from __future__ import annotations

import itertools
import logging
import re
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dkfac import _C
from dkfac.enums import AllreduceMethod
from dkfac.enums import AssignmentStrategy
from dkfac.enums import ComputeMethod
from dkfac.enums import DistributedStrategy

logger = logging.getLogger('dkfac')

_STATE_FORMAT = 1
_SCHEDULED = ('factor_update_steps', 'inv_update_steps', 'damping', 'factor_decay', 'kl_clip', 'lr')
_STRATEGIES = ('kaisa', 'spd', 'dp')
_DTYPES = {torch.float32: 'float32', torch.float64: 'float64', torch.bfloat16: 'bfloat16', torch.float16: 'float16'}
_FACTOR_KEYS = {'a_factor': 'A', 'g_factor': 'G'}
_communicators = itertools.count()  # a process-local id, the same on every rank that builds in the same order


def _enum(value: Any, enum: type, argument: str) -> Any:
    if isinstance(value, enum):
        return value
    if isinstance(value, str) and value.upper() in enum.__members__:
        return enum[value.upper()]
    names = ', '.join(repr(n.lower()) for n in enum.__members__)
    raise ValueError(f'{argument} must be one of {names} or {enum.__name__}, got {value!r}')


def _matches(patterns: list[str], *texts: str) -> bool:
    return any(re.search(p, t) for p in patterns for t in texts)


def _read(owner: weakref.ref, attribute: str, step: int) -> Any:
    value = getattr(owner(), attribute)
    return value(step) if callable(value) else value


def _check_positive(name: str, value: Any, *, allow_zero: bool = False, upper: float | None = None) -> None:
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f'{name} must be a number or a callable of the step, got {value!r}')
    low_ok = value >= 0 if allow_zero else value > 0
    if not low_ok or (upper is not None and value > upper):
        bound = f'[0, {upper}]' if upper is not None else ('>= 0' if allow_zero else '> 0')
        raise ValueError(f'{name} must be {bound}, got {value!r}')


class KFACPreconditioner:
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
    when initialised), ``spd_redundant_dim`` and ``timeout`` (seconds for dkfac's own subgroups).
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
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f'model must be a torch.nn.Module, got {type(model).__name__}')
        _check_positive('factor_update_steps', factor_update_steps)
        _check_positive('inv_update_steps', inv_update_steps)
        _check_positive('damping', damping)
        _check_positive('factor_decay', factor_decay, allow_zero=True, upper=1)
        if kl_clip is None:
            kl_clip = 0.0  # dkfac: None or 0 turns KL clipping off
        _check_positive('kl_clip', kl_clip, allow_zero=True)
        _check_positive('lr', lr, allow_zero=True)
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f'accumulation_steps must be an int > 0, got {accumulation_steps!r}')
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
        rank = dist.get_rank(group) if group is not None else 0
        grad_worker_fraction, distributed_strategy = self._resolve_fraction(grad_worker_fraction, size)
        if not colocate_factors and distributed_strategy is DistributedStrategy.MEM_OPT:
            warnings.warn('grad_worker_fraction=1/world_size (MEM_OPT) requires colocate_factors=True; enabling it',
                          stacklevel=2)
            colocate_factors = True
        if strategy != 'kaisa' and grad_worker_fraction != 1.0:
            raise ValueError(f"grad_worker_fraction applies to strategy='kaisa' only ({strategy!r} places its own "
                             f'work), got {grad_worker_fraction}')

        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self._accumulation_steps = accumulation_steps
        self._loglevel = loglevel
        self._update_factors_in_hook = update_factors_in_hook
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
        self.skip_layers = skip_layers
        self.symmetry_aware = symmetry_aware
        self.strategy = strategy
        self.unused_layer_policy = unused_layer_policy
        self.pi_damping = pi_damping
        self._rank = rank
        self._world_size = size

        self._names, self._modules, self._captures = [], [], []
        self._register(model)

        communicator = None
        if size > 1:
            backend = dist.get_backend(group)
            if backend != 'gloo':
                raise ValueError(f"process_group uses the {backend!r} backend; dkfac's CPU build communicates "
                                 "through Gloo groups (init_process_group('gloo'))")
            store = dist.distributed_c10d._get_default_store()
            ranks = dist.get_process_group_ranks(group)
            prefix = f'dkfac/py{next(_communicators)}/{ranks[0]}-{ranks[-1]}-{len(ranks)}/'
            seconds = timeout if timeout is not None else dist.default_pg_timeout.total_seconds()
            communicator = _C.communicator(group, store, prefix, float(seconds))  # group.WORLD is the default group
        self._communicator = communicator

        owner = weakref.ref(self)
        options = {name: (lambda step, a='_' + name: _read(owner, a, step)) for name in _SCHEDULED}
        options.update(
            accumulation_steps=accumulation_steps,
            compute_method=compute_method.name.lower(),
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            pi_damping=pi_damping,
            unused_layer_policy=unused_layer_policy,
            grad_worker_fraction=float(grad_worker_fraction),
            symmetry_aware=symmetry_aware,
            assignment_strategy=assignment_strategy.name.lower(),
            colocate_factors=colocate_factors,
            update_factors_in_hook=bool(update_factors_in_hook),
            allreduce_bucket_cap_mb=float(allreduce_bucket_cap_mb),
            strategy=strategy,
            factor_dtype=None if factor_dtype is None else _DTYPES[factor_dtype],
            inv_dtype=None if inv_dtype is None else _DTYPES[inv_dtype],
            grad_scale=self._scale_function(grad_scaler),
            spd_redundant_dim=spd_redundant_dim,
        )
        layers = [(name, m.weight, m.bias, c) for name, m, c in zip(self._names, self._modules, self._captures)]
        self._core = _C.Preconditioner(layers, options, communicator)
        logger.log(loglevel, 'dkfac: %s', self._core.describe())

    # --- registration --------------------------------------------------------------------------------
    def _register(self, model: torch.nn.Module) -> None:
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
            candidates.append((name, module.__class__.__name__))
            if _matches(self.skip_layers, name, module.__class__.__name__):
                continue
            self._names.append(name)
            self._modules.append(module)
            self._captures.append(capture)
            module.register_forward_hook(self._forward_hook(capture))
            a = module.weight[0].numel() + (module.bias is not None)
            g = module.weight.shape[0]
            logger.log(self._loglevel, 'dkfac: registered %s (%s): A %d x %d, G %d x %d', name,
                       module.__class__.__name__, a, a, g, g)
        for pattern in self.skip_layers:
            if not any(_matches([pattern], name, kind) for name, kind in candidates):
                layers = ', '.join(f'{name!r} ({kind})' for name, kind in candidates)
                warnings.warn(f'dkfac: skip_layers pattern {pattern!r} matches no layer, so it skips nothing; '
                              f'patterns are searched (re.search) in these layer names and kinds: {layers}',
                              stacklevel=3)
        if not self._names:
            raise ValueError('KFACPreconditioner found no torch.nn.Linear or torch.nn.Conv2d layer to precondition in '
                             f'{type(model).__name__} (after skip_layers={self.skip_layers!r} and frozen parameters)')

    @staticmethod
    def _forward_hook(capture: Any) -> Callable:
        # Holds the capture only (not the preconditioner): no reference cycle through the model.
        def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if not capture.enabled or not module.training or not torch.is_grad_enabled():
                return
            capture.capture_input(inputs[0])
            if output.requires_grad:
                output.register_hook(capture.capture_output_grad)

        return hook

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
    def _scale_function(grad_scaler: Any) -> Callable[[], float] | None:
        if grad_scaler is None:
            return None
        get = grad_scaler.get_scale if hasattr(grad_scaler, 'get_scale') else grad_scaler
        return lambda: float(get())

    # --- hyper-parameters, as kfac_pytorch exposes them -------------------------------------------------
    def _value(self, name: str) -> Any:
        value = getattr(self, '_' + name)
        return value(self.steps) if callable(value) else value

    damping = property(lambda self: self._value('damping'), doc='Damping at the current step.')
    factor_decay = property(lambda self: self._value('factor_decay'), doc='Factor decay at the current step.')
    kl_clip = property(lambda self: self._value('kl_clip'), doc='KL-clip bound at the current step (0: off).')
    lr = property(lambda self: self._value('lr'), doc='Learning rate KL clipping uses at the current step.')
    factor_update_steps = property(lambda self: self._value('factor_update_steps'),
                                   doc='Steps between factor updates, at the current step.')
    inv_update_steps = property(lambda self: self._value('inv_update_steps'),
                                doc='Steps between second-order updates, at the current step.')

    @property
    def steps(self) -> int:
        """K-FAC steps taken (calls to step())."""
        return self._core.steps

    @property
    def layers(self) -> list[tuple[str, torch.nn.Module]]:
        """The preconditioned layers as (name, module), in model order."""
        return list(zip(self._names, self._modules))

    @property
    def plan(self) -> str:
        """The step plan this job runs, in words (a str): how factors are reduced, who decomposes and
        preconditions each layer, what is broadcast (the C++ core's StepPlan; every rank computes the same
        one), and for SPD-KFAC what was measured and the fusion grouping in use."""
        return self._core.describe()

    # --- the step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Preconditions the registered layers' gradients in place (one K-FAC step).

        Updates factors on factor steps and the second-order state on inverse steps, then preconditions,
        KL-clips and writes the gradients. Call after backward (after all accumulation micro-batches), with
        gradients already averaged across ranks, and before the optimizer's step().
        """
        self._core.step()

    def reset_batch(self) -> None:
        """Drops what the hooks captured since the last factor update."""
        self._core.reset_batch()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state held on this rank, by kind, and their total."""
        sizes = dict.fromkeys(('a_factors', 'g_factors', 'a_batch', 'g_batch', 'a_inverses', 'g_inverses'), 0)
        kinds = {'a_factor': 'a_factors', 'g_factor': 'g_factors', 'a_eigenvectors': 'a_inverses',
                 'a_eigenvalues': 'a_inverses', 'a_inverse': 'a_inverses', 'g_eigenvectors': 'g_inverses',
                 'g_eigenvalues': 'g_inverses', 'g_inverse': 'g_inverses', 'denominator': 'g_inverses'}
        for state in self._core.layer_states():
            for key, tensor in state.items():
                sizes[kinds[key]] += tensor.numel() * tensor.element_size()
        for capture in self._captures:
            a, g = capture.pending_bytes()
            sizes['a_batch'] += a
            sizes['g_batch'] += g
        sizes['total'] = sum(sizes.values())
        return sizes

    def phase_times(self, total: bool = False) -> dict[str, float]:
        """Seconds per K-FAC phase in the last step (or summed over all steps with total=True)."""
        return self._core.total_times() if total else self._core.last_step_times()

    # --- state ---------------------------------------------------------------------------------------------
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """The state an exact resume needs, in kfac_pytorch's layout plus dkfac's second-order state.

        ``steps``; each hyper-parameter that is not a callable; with ``include_factors``, ``layers``
        ({name: {'A': A, 'G': G}}, what kfac_pytorch reads) and ``dkfac`` (format version, compute method,
        world size and rank, and each layer's second-order state as this rank holds it).
        """
        state: dict[str, Any] = {'steps': self.steps}
        for name in _SCHEDULED:
            value = getattr(self, '_' + name)
            if not callable(value):
                state[name] = value
        if include_factors:
            layer_states = self._core.layer_states()
            state['layers'] = {
                name: {'A': s.get('a_factor'), 'G': s.get('g_factor')} for name, s in zip(self._names, layer_states)
            }
            state['dkfac'] = {
                'format_version': _STATE_FORMAT,
                'compute_method': self.compute_method.name.lower(),
                'world_size': self._world_size,
                'rank': self._rank,
                'second_order': {
                    name: {k: v for k, v in s.items() if k not in _FACTOR_KEYS}
                    for name, s in zip(self._names, layer_states)
                },
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restores a state dict from dkfac's or kfac_pytorch's state_dict().

        dkfac's own (same compute method, world size and rank) restores the second-order state exactly.
        Otherwise, e.g. kfac_pytorch's, the factors are loaded and, with ``compute_inverses``, the second-order
        state is recomputed from them now (collective: every rank calls it).
        """
        if 'steps' not in state_dict:
            raise KeyError("state_dict has no 'steps' entry; is it a K-FAC preconditioner's state_dict()?")
        steps = int(state_dict['steps'])
        ours = state_dict.get('dkfac')
        if isinstance(ours, dict) and ours.get('format_version', _STATE_FORMAT) != _STATE_FORMAT:
            raise ValueError(f"dkfac state format {ours.get('format_version')} is not {_STATE_FORMAT}")
        exact = (isinstance(ours, dict) and ours.get('format_version') == _STATE_FORMAT
                 and ours.get('compute_method') == self.compute_method.name.lower()
                 and ours.get('world_size') == self._world_size and ours.get('rank') == self._rank)
        if self._communicator is not None:
            # Exact restore is rank-local (each rank's own second-order state); the recompute is collective,
            # so every rank must take the same branch: exact only if it is exact everywhere.
            exact = self._communicator.all_true(bool(exact))
        if 'layers' in state_dict:
            layers = state_dict['layers']
            if len(layers) != len(self._names):
                raise ValueError(f'state_dict holds {len(layers)} K-FAC layers, this model registers {len(self._names)}')
            unknown = sorted(set(layers) - set(self._names))
            if unknown:
                raise ValueError(f'state_dict holds K-FAC layers this model does not register: {unknown}')
            states = []
            for name in self._names:
                entry = layers[name]
                if 'A' not in entry or 'G' not in entry:
                    raise KeyError(f"state of layer {name!r} must hold 'A' and 'G'")
                s = {k: entry[v] for k, v in _FACTOR_KEYS.items() if entry[v] is not None}
                if exact:
                    s.update(ours['second_order'].get(name, {}))
                states.append(s)
        else:
            if compute_inverses:
                warnings.warn('state_dict holds no layer factors, so the second-order state cannot be computed; '
                              'skipping it', stacklevel=2)
            compute_inverses = False
            states = self._core.layer_states()
        for name in _SCHEDULED:
            if name in state_dict:
                setattr(self, '_' + name, state_dict[name])
        self._core.load_layer_states(steps, states)
        if 'layers' in state_dict and not exact and compute_inverses:
            self._core.update_second_order()

    def __repr__(self) -> str:
        params = {
            'accumulation_steps': self._accumulation_steps, 'allreduce_bucket_cap_mb': self.allreduce_bucket_cap_mb,
            'assignment_strategy': self.assignment_strategy, 'colocate_factors': self.colocate_factors,
            'compute_eigenvalue_outer_product': self.compute_eigenvalue_outer_product,
            'compute_method': self.compute_method, 'damping': self._damping,
            'distributed_strategy': self.distributed_strategy, 'factor_decay': self._factor_decay,
            'factor_dtype': self.factor_dtype, 'factor_update_steps': self._factor_update_steps,
            'grad_worker_fraction': self.grad_worker_fraction, 'inv_dtype': self.inv_dtype,
            'inv_update_steps': self._inv_update_steps, 'kl_clip': self._kl_clip, 'layers': len(self._names),
            'lr': self._lr, 'skip_layers': self.skip_layers, 'steps': self.steps, 'strategy': self.strategy,
            'symmetry_aware': self.symmetry_aware, 'world_size': self._world_size,
        }
        body = '\n'.join(f'  {k}={v},' for k, v in sorted(params.items()))
        return f'{type(self).__name__}(\n{body}\n)'
