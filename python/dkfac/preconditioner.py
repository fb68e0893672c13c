"""KFACPreconditioner: kfac_pytorch's preconditioner API on dkfac's C++ core.

Python finds the model's ``torch.nn.Linear`` / ``torch.nn.Conv2d`` modules; BaseKFACPreconditioner hooks them,
and the hooks hand each layer's input and output gradient to the core, which chooses the layers and the
distributed placement, builds the factors, reduces them, computes the second-order state, preconditions, clips
and runs every collective (the same code as the C++ API). What this file reports of the placement
(``distributed_strategy``, ``grad_worker_fraction``, ``colocate_factors``) is read back from the core.
"""

from __future__ import annotations

import enum
import functools
import inspect
import logging
import math
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any
from typing import TypeVar

import torch
import torch.distributed as dist

from dkfac import _C
from dkfac.base_preconditioner import BaseKFACPreconditioner
from dkfac.base_preconditioner import _CoreWarnings
from dkfac.base_preconditioner import _ENUMS
from dkfac.base_preconditioner import _KEYWORDS
from dkfac.base_preconditioner import _OPTIONS
from dkfac.base_preconditioner import _SCHEDULED
from dkfac.base_preconditioner import _default
from dkfac.base_preconditioner import _hyper_value
from dkfac.base_preconditioner import _plain_scalar
from dkfac.base_preconditioner import _fsdp1
from dkfac.base_preconditioner import _python_default
from dkfac.base_preconditioner import _stacklevel_outside_dkfac
from dkfac.base_preconditioner import _tensor_parallel
from dkfac.base_preconditioner import logger
from dkfac.enums import AllreduceMethod
from dkfac.enums import AssignmentStrategy
from dkfac.enums import ComputeMethod
from dkfac.enums import DistributedStrategy

# dkfac's own name of an option kfac_pytorch names otherwise (symmetric_comm: symmetry_aware) is a keyword too.
_DKFAC_NAMES = {o['name']: o['alias'] for o in _OPTIONS.values() if o['alias']}
# The options BaseKFACPreconditioner takes (kfac_pytorch's base class has them).
_BASE = ('factor_update_steps', 'inv_update_steps', 'damping', 'factor_decay', 'kl_clip', 'lr', 'accumulation_steps',
         'update_factors_in_hook')

def _core_value(value: Any) -> Any:
    """A keyword's value as the core takes it: kfac_pytorch's enums and torch dtypes by name."""
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, torch.dtype):
        return str(value).removeprefix('torch.')
    if isinstance(value, tuple):
        return list(value)
    return value


def _layout_fields(layout: dict[str, Any]) -> dict[str, Any]:
    """kfac_pytorch's fields for the KAISA grid as the core resolved it (``_C.kaisa_layout``; a running core's
    ``layout``): W = round(P f) with halves away from zero, f = 0 read as 1/P, and colocate_factors forced on
    for MEM_OPT are the core's rules (dkfac/assign/assignment.h); this only converts names."""
    return {
        'distributed_strategy': DistributedStrategy[layout['distributed_strategy'].replace('-', '_').upper()],
        'grad_worker_fraction': float(layout['grad_worker_fraction']),
        'colocate_factors': bool(layout['colocate_factors']),
    }


def _options_doc() -> str:
    lines = []
    for o in _OPTIONS.values():
        name = o['alias'] or o['name']
        default = repr(_python_default(o))
        kinds = ' (a number or a callable of the step)' if o['schedule'] else ''
        also = f"; dkfac's name: {o['name']}" if o['alias'] else ''
        lines.append(f'    ``{name}`` (default {default}{kinds}{also}): {o["doc"]}.')
    return '\n'.join(lines)


def _is_transformers_conv1d(module: torch.nn.Module) -> bool:
    """transformers' ``pytorch_utils.Conv1D`` (GPT-2's attention and MLP projections): y = x W + b with W stored
    [in, out], the transpose of a Linear's. Recognised by its class name and weight layout, without importing
    transformers."""
    weight = getattr(module, 'weight', None)
    # The class or a base of it: FSDP2's fully_shard makes each module an instance of a subclass (FSDPConv1D).
    return (any(c.__name__ == 'Conv1D' for c in type(module).__mro__) and isinstance(getattr(module, 'nf', None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf)


def _layer_kind(module: torch.nn.Module) -> str | None:
    """The core's kind of a leaf module it can precondition ('Linear', 'Conv2d', 'Embedding'), else None. A
    module under torch.nn.utils.parametrize (whose one child holds its parametrizations) is of its kind, set aside
    with its reason (_plain_gradient_reason)."""
    children = [name for name, _ in module.named_children()]
    if children and not (children == ['parametrizations'] and _parametrized(module)):
        return None
    if isinstance(module, torch.nn.Linear) or _is_transformers_conv1d(module):
        return 'Linear'
    if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv1d)):  # a Conv1d: the Conv2d of kernel height 1
        return 'Conv2d'
    if isinstance(module, torch.nn.Embedding):
        return 'Embedding'
    return None


# Layers that hold weights but have no K-FAC factors (named in a warning at construction).
_OTHER_WEIGHT_KINDS = (torch.nn.modules.conv._ConvNd, torch.nn.Bilinear)


def _parametrized(module: torch.nn.Module) -> bool:
    return bool(getattr(module, 'parametrizations', None)) and torch.nn.utils.parametrize.is_parametrized(module)


def _conv2d_geometry(module: torch.nn.Module) -> tuple[Any, ...]:
    """The kernel, stride, dilation, padding, padding mode and padding {left, right, top, bottom} of a Conv2d, or
    of a Conv1d as the Conv2d of kernel height 1 it is (docs/MATH.md section 1.3; its capture sees its input and
    output gradient with a height of 1: _CaptureHook)."""
    padding = module.padding if isinstance(module.padding, str) else tuple(module.padding)
    reversed_padding = tuple(module._reversed_padding_repeated_twice)
    if isinstance(module, torch.nn.Conv1d):
        return ((1, *module.kernel_size), (1, *module.stride), (1, *module.dilation),
                padding if isinstance(padding, str) else (0, *padding), module.padding_mode, (*reversed_padding, 0, 0))
    return (tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation), padding, module.padding_mode,
            reversed_padding)


def _own_forward(module: torch.nn.Module) -> str:
    """The stock class whose forward the module's class overrides ('' where it keeps it): a subclass of an
    Embedding that looks up positions rather than its argument (Whisper's, BART's and OPT's learned positional
    embeddings), or that scales its output (Gemma's and BART's scaled word embeddings), computes something else from
    its input than the stock layer, which K-FAC's factors describe."""
    for stock in (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv1d, torch.nn.Embedding):
        if isinstance(module, stock):
            return stock.__name__ if type(module).forward is not stock.forward else ''
    if _is_transformers_conv1d(module):
        base = next(c for c in type(module).__mro__ if c.__name__ == 'Conv1D')
        return 'Conv1D' if type(module).forward is not base.forward else ''
    return ''


def _refuse_fsdp1(model: torch.nn.Module) -> None:
    """FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) keeps a wrapped module's parameters as one flat
    Parameter (``use_orig_params=False``) or as flat shards shaped ``[numel]`` (``use_orig_params=True``): no layer
    holds a weight K-FAC can read. Refused naming the wrapper and what works, in place of errors about the layers'
    shapes or the optimizer's parameters."""
    # Not imported: no module can be one (imported here, it would cost every job torch's FSDP import).
    fsdp1 = getattr(sys.modules.get('torch.distributed.fsdp'), 'FullyShardedDataParallel', None)
    if fsdp1 is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, fsdp1):
            raise ValueError(_fsdp1('the model is' if not name else f'its module {name!r} is'))


def _never_called(model: torch.nn.Module) -> set[int]:
    """ids of the Linear modules ``model`` registers but never calls as modules: ``torch.nn.MultiheadAttention``
    (inside ``nn.TransformerEncoderLayer`` and ``DecoderLayer`` too) applies its ``out_proj``'s weight and bias
    through ``F.multi_head_attention_forward``, so no module hook ever sees that layer's input."""
    return {id(m.out_proj) for m in model.modules()
            if isinstance(m, torch.nn.MultiheadAttention) and isinstance(getattr(m, 'out_proj', None), torch.nn.Module)}


def _plain_gradient_reason(module: torch.nn.Module, never_called: set[int] | frozenset[int] = frozenset()) -> str:
    """Why ``module`` cannot be preconditioned even though its kind can ('' when it can): a sparse Embedding, a
    MultiheadAttention's out_proj (``_never_called``), a weight computed from other parameters, a class that
    overrides the stock layer's forward."""
    if id(module) in never_called:
        return ("torch.nn.MultiheadAttention's out_proj: MultiheadAttention applies its weight inside "
                'F.multi_head_attention_forward and never calls it as a module, so no hook can capture its input '
                "(its in_proj_weight is no layer either); use a module of separate Linear projections to precondition "
                'attention')
    overridden = _own_forward(module)
    if overridden:
        return (f"its class overrides {overridden}.forward, so what it computes from its input may differ from the "
                f"stock {overridden}'s (a learned positional embedding that looks up positions, not its argument; a "
                "scaled output): K-FAC's factors would not describe it")
    if _parametrized(module):
        return ('its parameters are computed by torch.nn.utils.parametrize (weight_norm, spectral_norm, orthogonal, '
                '...) from others, which take the gradient: K-FAC preconditions a layer whose weight is its own '
                'Parameter')
    if module._parameters.get('weight') is None and isinstance(getattr(module, 'weight', None), torch.Tensor):
        return ("its weight is no Parameter of the layer but computed from others before each forward pass "
                "(torch.nn.utils.weight_norm's weight_g and weight_v, spectral_norm's weight_orig, a pruning mask), "
                'which take the gradient: K-FAC preconditions a layer whose weight is its own Parameter')
    if isinstance(module, torch.nn.Embedding) and module.sparse:
        return ('a sparse Embedding (sparse=True): K-FAC preconditions dense gradients; build it with sparse=False '
                'to precondition it')
    return ''


def _tied_to(name: str, module: torch.nn.Module, owners: dict[int, list[str]]) -> list[str]:
    """The other modules holding one of ``module``'s own parameters (tied weights, e.g. GPT-2's lm_head and wte)."""
    others: list[str] = []
    for parameter in module._parameters.values():
        if parameter is not None:
            others += [o for o in owners.get(id(parameter), []) if o != name and o not in others]
    return others


def _log_plain_parameters(model: torch.nn.Module, layers: dict[torch.nn.Module, Any],
                          set_aside: dict[torch.nn.Module, str], loglevel: int, skip_layers: list[str]) -> None:
    """Logs, at ``loglevel``, every trainable parameter no registered layer holds, grouped by why; and warns of the
    layers of kinds K-FAC has no factors for that ``skip_layers`` does not name."""
    by_reason: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if module in layers:
            continue
        trainable = [p for p, t in module._parameters.items() if t is not None and t.requires_grad]
        if not trainable:
            continue
        if module in set_aside:
            reason = set_aside[module]
        elif any(True for _ in module.children()):
            reason = f'parameters of a {type(module).__name__} itself, outside any layer K-FAC preconditions'
        else:
            reason = f'{type(module).__name__} is not a layer kind K-FAC preconditions'
        prefix = f'{name}.' if name else ''
        by_reason.setdefault(reason, []).extend(prefix + p for p in trainable)
    if not by_reason:
        return
    lines = [f'{", ".join(names)} ({reason})' for reason, names in by_reason.items()]
    logger.log(loglevel, 'dkfac: %d trainable parameters keep their plain gradient (the optimizer applies it '
               'as given): %s', sum(len(n) for n in by_reason.values()), '; '.join(lines))
    # Weight layers of kinds it has no factors for (Conv3d, ConvTranspose, Bilinear) are said aloud: a model made
    # of them would otherwise train with K-FAC on its other layers alone, with a word at the loglevel only.
    def skipped(name: str, module: torch.nn.Module) -> bool:  # the core's rule: ECMAScript, not Python's re
        return _C.skip_layers_match(list(skip_layers), [name, type(module).__name__])

    other_kinds = [f'{name!r} ({type(module).__name__})' for name, module in model.named_modules()
                   if isinstance(module, _OTHER_WEIGHT_KINDS) and module not in layers
                   and module not in set_aside and any(p.requires_grad for p in module.parameters())
                   and not skipped(name, module)]
    if other_kinds:
        warnings.warn(f'dkfac: {len(other_kinds)} layer(s) of kinds K-FAC does not precondition keep their plain '
                      f'gradient: {", ".join(other_kinds[:6])}{" ..." if len(other_kinds) > 6 else ""} (K-FAC '
                      'preconditions Linear, Conv2d, Conv1d, Embedding and transformers\' Conv1D layers)',
                      stacklevel=_stacklevel_outside_dkfac())
    # Weights a module holds itself, outside any layer (a mixture of experts' fused experts: 3-D Parameters, 90% of
    # a Mixtral's parameters), said aloud where they are a large share of what trains.
    held = set()  # the layers and the set-aside (every candidate not chosen) or other-kind modules, and under them
    for module in model.modules():
        if module in layers or module in set_aside or isinstance(module, _OTHER_WEIGHT_KINDS):
            held.update(id(p) for p in module.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    own = [(name, module, [(k, tuple(p.shape)) for k, p in module._parameters.items() if p is not None
                           and p.requires_grad and p.dim() >= 2 and id(p) not in held])
           for name, module in model.named_modules() if not skipped(name, module)]
    own = [(name, module, weights) for name, module, weights in own if weights]
    share = sum(math.prod(shape) for _, _, weights in own for _, shape in weights) / max(trainable, 1)
    if share >= 0.1:
        shown = '; '.join(f'{name!r} ({type(module).__name__}: '
                          + ', '.join(f'{k} {list(shape)}' for k, shape in weights) + ')'
                          for name, module, weights in own[:3])
        warnings.warn(f'dkfac: {share:.0%} of the trainable parameters are weights that modules hold themselves, '
                      f'outside any layer K-FAC preconditions, and keep their plain gradient: {shown}'
                      f'{" ..." if len(own) > 3 else ""} (a mixture of experts\' fused experts, 3-D Parameters, are '
                      'not preconditioned yet)', stacklevel=_stacklevel_outside_dkfac())


_Init = TypeVar('_Init', bound=Callable[..., None])


def _names_its_keywords(init: _Init) -> _Init:
    """``init`` refusing an unknown keyword with the list of its keywords (Python's own TypeError lists none)."""
    parameters = inspect.signature(init).parameters
    keywords = ', '.join(p for p in parameters if p not in ('self', 'model'))

    @functools.wraps(init)
    def checked(*args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in parameters:
                raise TypeError(f'KFACPreconditioner() got an unexpected keyword argument {name!r}; its keywords are '
                                f'{keywords}')
        init(*args, **kwargs)

    return checked  # type: ignore[return-value]


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC gradient preconditioner, a drop-in for kfac_pytorch's ``kfac.preconditioner.KFACPreconditioner``.

    Registers every ``torch.nn.Linear``, ``Conv2d``, ``Conv1d`` and ``Embedding`` and transformers' ``Conv1D`` leaf
    of ``model`` whose parameters all require grad (minus ``skip_layers``, matched against the ``named_modules()``
    name, the kind and the class name; layers of other kinds that hold weights are named in a warning),
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
    when initialised; a pipeline stage's: its data-parallel group), ``model_parallel_group`` (a pipeline stage's:
    the ranks holding the other stages of its replica, over which KL clipping sums; "Pipeline
    parallel" in docs/PYTHON.md), ``tensor_parallel_factors`` (layers split by torch.distributed.tensor.parallel:
    'block_diagonal', each rank's slice with the factors it builds alone, or 'exact', gathered over the
    tensor-parallel ranks; "Tensor parallel" in docs/PYTHON.md), ``spd_redundant_dim``, ``timeout`` (seconds for
    dkfac's own subgroups; default: the process group's own timeout) and ``large_factor_dim`` (a layer with a
    factor wider than this is warned about when the preconditioner is built, with the factor's memory and the cost
    of its second-order updates; 0: never).
    ``symmetric_comm`` and ``balance`` are dkfac's names for ``symmetry_aware`` and ``assignment_strategy`` (give
    one of each pair).
    ``sharded_placement`` says where the K-FAC work of layers sharded by FSDP2's ``fully_shard`` (or HSDP) runs:
    'replicated' (every rank gathers each gradient and runs the strategy as under DDP) or 'owner' (one owner per
    layer and replica holds its factors and second-order state, gathers the gradient's shards and scatters the
    preconditioned rows back: K-FAC memory about 1/P per rank; strategy 'kaisa', whose grad_worker_fraction it
    sets to one grad worker per replica, or 'dp'; see docs/STRATEGIES.md, "Sharded models").
    ``precondition_dtype`` 'tf32' runs the preconditioning products in TF32 on CUDA (a fast mode whose error
    docs/PERFORMANCE.md measures; no effect on a CPU); 'float32', the default, keeps them exact.
    ``eigh_interval`` k > 1 (eigen method, a fast mode) computes the eigendecompositions in full every k inverse
    updates only, and between them refreshes each factor's previous eigenbasis by one subspace-iteration step (a
    QR, no eigensolver; docs/MATH.md section 2.6); 1, the default, always in full.
    ``second_order_concurrency`` is how many layers' second-order updates run at once (1, the default: one layer at
    a time; 0: as many as ``torch.get_num_threads()``): on a CPU each on one thread, on CUDA each from a host thread
    of its own on a stream of its own.
    ``second_order_lag`` k > 0 (a fast mode) computes each second-order update after the first beside the next k
    steps, on another thread (on CUDA, a side stream), and installs it at the k-th: those steps precondition with
    the state before it, so no step waits for the eigendecompositions (docs/MATH.md section 2.8); 0, the default,
    installs each update at the step that computes it.
    ``stack_layers`` (on by default, exact) preconditions the layers of one shape together: their eigenbases (or
    inverses) and denominators are held as slices of one stacked tensor per shape, and each group of them takes four
    batched products in place of four per layer (equal to one at a time to rounding; docs/MATH.md section 2.9).
    With ``eigen_adam`` the eigenbases are stacked and each layer's Adam moments stay its own. Off, and with
    ``compute_eigenvalue_outer_product=False`` (not ``eigen_adam``), layer by layer.
    ``pad_widths`` (8 by default, exact) holds those stacks with their widths padded up to a multiple of it (the
    eigenbases or inverses with the identity in the pad, the gradients with zeros), so that the batched products
    run on aligned widths (equal to unpadded to rounding; the pads' bytes are ``memory_usage()['stack_padding']``);
    1 leaves them unpadded.
    ``cuda_graphs`` (off by default until measured on a GPU) replays, on CUDA, one captured CUDA graph of a step's
    preconditioning, NaN guard, KL clipping and gradient writes where the step updates neither factors nor
    second-order state and moves nothing between ranks: exact (the same kernels), in place of a few kernel launches
    per layer. A graph is captured at the second such step in a row whose gradients and state are where the
    first's were, and replayed while they stay there; ``cuda_graph_report()`` says how many steps replayed one,
    and why the others did not (a CPU, ``eigen_adam``, a gradient broadcast, gradients moved between steps).
    ``fold_in_hooks`` (on by default, exact) folds each layer's factor batches into its running factors in its
    backward hook, once its ``accumulation_steps`` passes are in, where no factor is averaged across ranks (one
    process, DP-KFAC), so that no batch is held until ``step()`` (docs/MATH.md section 1.8). A layer's first factor
    update, a layer whose passes at a factor update did not match ``accumulation_steps``, shared-input groups and a
    ``grad_scaler`` fold at ``step()``; a layer whose hook folded and that runs more passes before ``step()`` warns,
    drops them and folds at ``step()`` from then on; a step that fails after its backward pass, or whose batch
    ``reset_batch()`` drops, keeps what the hooks folded (``reset_batch()`` says so once, and ``state_dict()``
    between backward and ``step()`` says that it holds that batch): a loop that skips steps after their backward
    pass (loss spikes) and wants them out of the factors passes ``fold_in_hooks=False``.
    ``shared_input_layers`` (regular expressions with one capture group, e.g. ``'(query|key|value)$'``) groups the
    layers that read one input tensor, such as an attention block's query, key and value: they share one A factor
    and its decomposition, which are built, reduced, decomposed and held once (exact: the same results as without
    it; every factor step checks that the members were given the same tensor; docs/MATH.md section 2.7).

    ``distributed_strategy``, ``grad_worker_fraction`` and ``colocate_factors`` are KAISA's grid as the core
    placed the work when the preconditioner was built: W = round(P f) gradient workers per layer (halves away
    from zero), f = 0 meaning 1/P, and colocate_factors turned on, with a warning, for MEM_OPT (W = 1 < P).

    Warnings, the C++ core's included, go through Python's ``warnings`` module (UserWarning, attributed to
    the caller's line) and name layers by their torch.nn class; the registered layers and the step plan are
    logged through the ``dkfac`` logger at ``loglevel``.
    """

    @_names_its_keywords
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        # kfac_pytorch's keywords, in its order (a schedule: a number or a callable of the K-FAC step)
        factor_update_steps: Callable[[int], int] | int = _default('factor_update_steps'),
        inv_update_steps: Callable[[int], int] | int = _default('inv_update_steps'),
        damping: Callable[[int], float] | float = _default('damping'),
        factor_decay: Callable[[int], float] | float = _default('factor_decay'),
        kl_clip: Callable[[int], float] | float | None = _default('kl_clip'),
        lr: Callable[[int], float] | float = _default('lr'),
        accumulation_steps: int = _default('accumulation_steps'),
        allreduce_bucket_cap_mb: float = _default('allreduce_bucket_cap_mb'),
        assignment_strategy: AssignmentStrategy | str = _default('assignment_strategy'),
        colocate_factors: bool = _default('colocate_factors'),
        compute_method: ComputeMethod | str = _default('compute_method'),
        compute_eigenvalue_outer_product: bool = _default('compute_eigenvalue_outer_product'),
        grad_worker_fraction: DistributedStrategy | float | str = _default('grad_worker_fraction'),
        symmetry_aware: bool = _default('symmetry_aware'),
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = _default('factor_dtype'),
        inv_dtype: torch.dtype | None = _default('inv_dtype'),
        skip_layers: list[str] | str | None = _default('skip_layers'),
        shared_input_layers: list[str] | str | None = _default('shared_input_layers'),
        update_factors_in_hook: bool = _default('update_factors_in_hook'),
        loglevel: int = logging.DEBUG,
        # dkfac's own
        strategy: str = _default('strategy'),
        memory_budget: int = _default('memory_budget'),
        auto_recheck_steps: int = _default('auto_recheck_steps'),
        unused_layer_policy: str = _default('unused_layer_policy'),
        pi_damping: bool = _default('pi_damping'),
        large_factor_dim: int = _default('large_factor_dim'),
        diagonal_factor_dim: int = _default('diagonal_factor_dim'),
        kfac_approx: str = _default('kfac_approx'),
        precondition_dtype: str = _default('precondition_dtype'),
        eigh_interval: int = _default('eigh_interval'),
        second_order_concurrency: int = _default('second_order_concurrency'),
        second_order_lag: int = _default('second_order_lag'),
        stack_layers: bool = _default('stack_layers'),
        pad_widths: int = _default('pad_widths'),
        cuda_graphs: bool = _default('cuda_graphs'),
        fold_in_hooks: bool = _default('fold_in_hooks'),
        eigen_adam: bool = _default('eigen_adam'),
        adam_beta1: float = _default('adam_beta1'),
        adam_beta2: float = _default('adam_beta2'),
        adam_eps: float = _default('adam_eps'),
        start_preconditioning_step: int = _default('start_preconditioning_step'),
        sharded_placement: str = _default('sharded_placement'),
        spd_redundant_dim: int | None = _default('spd_redundant_dim'),
        spd_profile_steps: int = _default('spd_profile_steps'),
        spd_fusion: list[int] = _default('spd_fusion'),
        process_group: Any = None,
        timeout: float | None = None,
        model_parallel_group: Any = None,
        tensor_parallel_factors: str = 'block_diagonal',
        symmetric_comm: bool | None = None,
        balance: AssignmentStrategy | str | None = None,
    ) -> None:
        arguments = dict(locals())
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f'model must be a torch.nn.Module, got {type(model).__name__}')
        # Each option's keyword as given (the core's messages name it so): kfac_pytorch's name, or dkfac's.
        typed = {name: o['alias'] or name for name, o in _OPTIONS.items()}
        for name, alias in _DKFAC_NAMES.items():
            if arguments[name] is not None:
                if arguments[alias] != _default(alias):
                    raise TypeError(f'{alias} and {name} name one option; give one')
                typed[name] = name
        # Each option's value by dkfac's name, as the user sees it (lists copied: the defaults are shared).
        values = {name: arguments[keyword] for name, keyword in typed.items()}
        values = {name: list(v) if isinstance(v, list) else v for name, v in values.items()}
        values = {name: _hyper_value(typed[name], v) if name in _SCHEDULED else _plain_scalar(typed[name], v)
                  for name, v in values.items()}
        for name, v in values.items():  # pybind would read a Python int beyond 64 bits as a bool ("got true")
            if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
                raise ValueError(f'{typed[name]} must be an integer of at most 64 bits, got {v}')
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds (None: the process group's), got {timeout!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError('process_group must be a torch.distributed ProcessGroup (None: the default group), got '
                            f'{type(process_group).__name__}')
        core = {name: _core_value(v) for name, v in values.items()}
        for patterns in ('skip_layers', 'shared_input_layers'):  # one pattern, a list, or None (none)
            if isinstance(core[patterns], str):
                core[patterns] = [core[patterns]]
            core[patterns] = list(core[patterns] or [])
        resolved = dict(_C.option_values({typed[k]: v for k, v in core.items()}))  # checked by the core

        compute_method = _ENUMS['compute_method'][resolved['compute_method'].upper()]
        if (compute_method == ComputeMethod.EIGEN and values['compute_eigenvalue_outer_product']
                and not values['colocate_factors']):  # kfac_pytorch's rule, kept for its users
            raise ValueError('colocate_factors must be True to use compute_eigenvalue_outer_product')
        if grad_scaler is not None and not (hasattr(grad_scaler, 'get_scale') or callable(grad_scaler)):
            raise TypeError(f'grad_scaler must have get_scale() or be a callable returning the scale, got {grad_scaler!r}')

        group = process_group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        size = dist.get_world_size(group) if group is not None else 1

        # kfac_pytorch's attributes, with the values as given (or defaulted).
        for name, value in values.items():
            if name not in _BASE:
                setattr(self, _OPTIONS[name]['alias'] or name, value)
        self.skip_layers = list(core['skip_layers'])
        self.shared_input_layers = list(core['shared_input_layers'])
        self.compute_method = compute_method
        self.allreduce_method = (AllreduceMethod.ALLREDUCE_BUCKETED if values['allreduce_bucket_cap_mb'] > 0
                                 else AllreduceMethod.ALLREDUCE)
        self.grad_scaler = grad_scaler

        try:
            layers = self._register(model, loglevel, tensor_parallel_factors)
        except ValueError as error:
            if model_parallel_group is None or 'found no' not in str(error):
                raise
            raise ValueError(f'{error}. This part of the model (a pipeline stage) cannot build a preconditioner, '
                             "and the other parts' KL clipping sums over model_parallel_group would wait for it: "
                             'build theirs with kl_clip=None and no model_parallel_group (no sum across the parts), '
                             'or give it a layer K-FAC preconditions') from None
        self._model_ref = weakref.ref(model)  # to name a registered module the model no longer holds (step())
        if process_group is None and size > 1:
            # The default group is the tensor-parallel group itself: no data parallelism, nothing to reduce.
            splits = [s for s in (_tensor_parallel(name, m) for m, (name, _) in layers.items()) if s is not None]
            if splits and sorted(dist.get_process_group_ranks(group)) == sorted(
                    dist.get_process_group_ranks(splits[0].group)):
                group, size = None, 1
        options = {typed[k]: v for k, v in core.items() if k not in _BASE}
        options['grad_scale'] = self._scale_function(grad_scaler)
        # repr(): every option (kfac_pytorch's names and values as given), then the fields kfac_pytorch derives.
        defaults = {(_OPTIONS[n]['alias'] or n): v for n, v in values.items() if n not in _BASE}
        defaults.update(allreduce_method=self.allreduce_method, compute_method=compute_method,
                        grad_scaler=grad_scaler is not None, skip_layers=self.skip_layers,
                        shared_input_layers=self.shared_input_layers, world_size=size)
        super().__init__(
            layers, options=options, process_group=group if size > 1 else None, timeout=timeout,
            model_parallel_group=model_parallel_group, tensor_parallel_factors=tensor_parallel_factors,
            defaults=defaults, loglevel=loglevel,
            **{name: values[name] for name in _BASE})
        # The grid the core placed the work on (its rules: dkfac/assign/assignment.h), as kfac_pytorch names it.
        layout = _layout_fields(self._core.layout)
        for name, value in layout.items():
            setattr(self, name, value)
        self._defaults.update(layout)  # repr()

    # --- registration --------------------------------------------------------------------------------
    def _register(self, model: torch.nn.Module, loglevel: int,
                  tensor_parallel_factors: str = 'block_diagonal') -> dict[torch.nn.Module, tuple[str, Any]]:
        """{module: (name, capture)} of the layers to precondition, in model order (hooked by the base): the
        torch.nn.Linear, Conv2d and Embedding leaves and transformers' Conv1D, chosen by the core's rules
        (dkfac/layers/discovery.h: frozen, grouped, sparse, tied and skip_layers), the same ones the C++ front end
        applies, with the same warnings and errors. Every trainable parameter left to the optimizer is logged at
        ``loglevel`` with the reason."""
        _refuse_fsdp1(model)
        owners: dict[int, list[str]] = {}  # id(parameter) -> the modules holding it (tied weights: several)
        for name, module in model.named_modules():
            for parameter in module._parameters.values():
                if parameter is not None:
                    owners.setdefault(id(parameter), []).append(name)
        modules, candidates = [], []
        never_called = _never_called(model)
        for name, module in model.named_modules():
            kind = _layer_kind(module)
            if kind is None:
                continue
            trainable = all(p.requires_grad for p in module.parameters())
            candidates.append((name, type(module).__name__, kind, trainable, getattr(module, 'groups', 1),
                               _plain_gradient_reason(module, never_called), _tied_to(name, module, owners)))
            modules.append(module)
        with _CoreWarnings():
            chosen, reasons = _C.choose_layers(candidates, self.skip_layers, type(model).__name__)
        layers: dict[torch.nn.Module, tuple[str, Any]] = {}
        for index in chosen:
            name, module = candidates[index][0], modules[index]
            kind = candidates[index][2]
            if kind == 'Embedding':
                capture = _C.embedding_capture(module.num_embeddings)
            elif kind == 'Linear':  # a row-parallel slice's bias is preconditioned by place 0 (_TensorParallel)
                split = _tensor_parallel(name, module, tensor_parallel_factors)
                bias = module.bias is not None and (split is None or split.bias_here())
                capture = _C.linear_capture(bias, transposed=not isinstance(module, torch.nn.Linear))
            else:
                capture = _C.conv2d_capture(module.bias is not None, *_conv2d_geometry(module))
            layers[module] = (name, capture)
        _log_plain_parameters(model, layers, {modules[i]: reasons[i] for i in range(len(modules)) if reasons[i]},
                              loglevel, self.skip_layers)
        # Layers set aside only because they were frozen (the core would choose them trainable): step() says so once
        # if one trains later (unfrozen).
        self._frozen_aside = []
        if any(not candidate[3] for candidate in candidates):
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                with _CoreWarnings():
                    trainable, _ = _C.choose_layers([c[:3] + (True,) + c[4:] for c in candidates], self.skip_layers,
                                                    type(model).__name__)
            self._frozen_aside = [(candidates[i][0], modules[i]) for i in sorted(set(trainable) - set(chosen))]
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


KFACPreconditioner.__doc__ = (KFACPreconditioner.__doc__ or '') + '\n    Keyword arguments:\n\n' + _options_doc() + '\n'
