"""BaseKFACPreconditioner: what every K-FAC preconditioner shares once its layers are chosen.

The counterpart of kfac_pytorch's ``kfac.base_preconditioner.BaseKFACPreconditioner``: the hyper-parameters
(each a number or a callable of the K-FAC step), the hooks that feed each layer's capture, ``step()``, the
state dicts, ``memory_usage()``, ``reset_batch()`` and ``__repr__``. The K-FAC work (factors, second-order
state, preconditioning, KL clipping and every collective) runs in the C++ core, ``dkfac._C.Preconditioner``;
this class hands it the layers and options and re-raises its warnings through Python's ``warnings`` module.
``dkfac.preconditioner.KFACPreconditioner`` finds a model's layers and reports the placement the core chose.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import sys
import warnings
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from types import FrameType
from types import TracebackType
from typing import Any
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from dkfac import _C
from dkfac.enums import AssignmentStrategy
from dkfac.enums import ComputeMethod

logger = logging.getLogger('dkfac')

_STATE_FORMAT = 2  # what the plan places on a rank, with `held` (Stateful for DCP): the one format read
# The core's options (dkfac/options.h, each declared once): the keywords, their defaults and checks come from this
# table. A keyword is the option's kfac_pytorch name where it has one.
_OPTIONS = {o['name']: o for o in _C.option_table()}
_KEYWORDS = {(o['alias'] or o['name']): o for o in _OPTIONS.values()}
_SCHEDULED = tuple(name for name, o in _OPTIONS.items() if o['schedule'])  # a number or a callable of the step
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


def _default(keyword: str) -> Any:
    """The default of a preconditioner's keyword ``keyword``, from the core's option table."""
    return _python_default(_KEYWORDS[keyword])

# The core's layer state entries (key, is a factor, side 'a' or 'g'); factors by kfac_pytorch's names 'A', 'G'.
_STATE_ENTRIES = _C.layer_state_entries()
_FACTOR_KEYS = {key: side.upper() for key, factor, side, _ in _STATE_ENTRIES if factor}
# Adam's moments in the eigenbasis (eigen_adam): optimizer state, kept by every state dict (none recomputes them).
_MOMENT_KEYS = {key for key, _, _, moment in _STATE_ENTRIES if moment}
_communicators = itertools.count()  # a process-local id, the same on every rank that builds in the same order


def _plain_scalar(name: str, value: Any) -> Any:
    """An option's value with a one-element tensor or a numpy scalar taken as the Python number it holds (pybind read
    them as bools: "lr must be a number, got true"); a tensor of several elements refused naming the option."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f'{name} must be a number, got a tensor of shape {list(value.shape)}')
        return value.item()
    if type(value).__module__ == 'numpy' and getattr(value, 'ndim', None) == 0:  # np.float32(0.01)
        return value.item()
    return value


def _hyper_value(name: str, value: Any) -> Any:
    """A hyper-parameter as given (a number, or a callable of the step; _plain_scalar's numbers); a string is refused
    naming the option (some options parsed one, others did not, and one failed in pybind)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f'{name} must be a number or a callable of the step, got the string {value!r}')
    return _plain_scalar(name, value)


def _read(owner: weakref.ref, attribute: str, step: int) -> Any:
    value = getattr(owner(), attribute)
    return value(step) if callable(value) else value


def _stacklevel_outside_dkfac() -> int:
    """The ``stacklevel`` with which the caller's ``warnings.warn`` names the innermost frame outside the
    dkfac package: the user's line that called into dkfac (what Python 3.12's skip_file_prefixes does)."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get('__name__', '').partition('.')[0] == 'dkfac':
        level, frame = level + 1, frame.f_back
    return level


# Module -> the preconditioner that registered it (weakly): one model, one preconditioner.
_PRECONDITIONED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The preconditioners given a model_parallel_group, as (weak reference, group): two on one rank with one group are
# warned about (an interleaved pipeline's stages each with its own: their KL sums pair the wrong stages).
_MODEL_PARTS: list[tuple[weakref.ref, Any]] = []


# The preconditioners an optimizer's step is checked against (_optimizer_stepped), and the hook's handle.
_WATCHING: weakref.WeakSet = weakref.WeakSet()
_OPTIMIZER_HOOK: list = []


def _optimizer_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any torch.optim optimizer's step: where a preconditioner saw a forward pass since its last step(), so
    that its step() has not run since that backward pass, the layers whose weights this optimizer holds are marked
    written. Fused optimizers write the weights without moving their version counters, which the core compares
    otherwise; the next step() refuses either way (C++ FactorCapture::mark_weight_written). A post-hook, not a pre-hook:
    a wrapper's step (accelerate's, dkfac.optim.KFAC's) runs step() before its inner optimizer's step, so that by then
    nothing is left to mark."""
    for preconditioner in list(_WATCHING):
        if preconditioner._retired or not preconditioner._forward_seen[0]:
            continue
        held = {id(p) for group in optimizer.param_groups for p in group['params']}
        for (weight, _), capture in zip(preconditioner._bound, preconditioner._captures):
            if id(weight) in held:
                capture.mark_weight_written()


def _release(handles: list, hooks: list[_CaptureHook], modules: list, owner: weakref.ref,
             previous: dict[torch.nn.Module, weakref.ref]) -> None:
    for handle in handles:
        handle.remove()
    for hook in hooks:
        hook.release()
    for module in modules:
        if _PRECONDITIONED.get(module) is owner:
            # A preconditioner that goes before it took the layers over (_take_over) leaves them to the one it would
            # have superseded, if that one still lives.
            before = previous.get(module)
            if before is not None and before() is not None and not before()._retired:
                _PRECONDITIONED[module] = before
            else:
                del _PRECONDITIONED[module]


# --- capture under torch.compile ------------------------------------------------------------------------------
# Dynamo cannot trace a call into the C++ capture, and a graph break inside a module hook made it give up on the
# whole forward: a hooked model compiled nothing. Traced, the hooks call two custom operators instead, which
# Dynamo records into the graph like any other and which run the capture when the compiled code runs. Neither
# may be removed as dead code, nor run twice: the input's operator declares that it writes a counter of its own
# (`passes`), which keeps it in the forward graph only (marked side-effectful instead, AOTAutograd's partitioner
# also copied it into the backward graph, where its input is saved anyway: every A captured twice); the gradient's
# is marked side-effectful and can only be in the backward graph. They find their capture by a number
# (_CAPTURES), and check at run time whether it captures this step, so that one graph serves factor and
# non-factor steps alike. The gradient's is called by the backward of a function of the output (_CapturedOutput),
# whose result the forward hook returns. Eager passes call the capture directly.
# Both are kept out of CUDA graphs (torch.compile's mode='reduce-overhead'): a replay would run the kernels the
# capture launched while being recorded, not the capture, so no factor would take the new batch, and the capture's
# own checks (is this a factor step? which pass?) would not run. inductor runs them between its graphs.
_NOT_IN_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,)
_CAPTURES: dict[int, _CaptureHook] = {}  # key -> the hook, with its capture and its preconditioner's forward-seen flag
_capture_keys = itertools.count()


@torch.library.custom_op('dkfac::capture_input', mutates_args=('passes',), tags=_NOT_IN_CUDA_GRAPHS)
def _capture_input_op(x: torch.Tensor, passes: torch.Tensor, key: int) -> None:
    hook = _CAPTURES.get(key)  # there while its capture is (release() takes it out)
    if hook is None:
        return
    capture = hook._capture
    hook.seen[0] = True  # as an eager pass says: a forward since step() (the optimizer hook reads it)
    if capture.enabled:
        hook.refuse_resized()  # a compiled graph runs on after a weight is resized in place: no guard sees it
        capture.capture_input(x, at_once=True)  # x's buffer may be reused once this returns (inductor's plan)
        passes.add_(1)


@_capture_input_op.register_fake
def _(x: torch.Tensor, passes: torch.Tensor, key: int) -> None:
    return None


@torch.library.custom_op('dkfac::capture_output_grad', mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def _capture_output_grad_op(grad: torch.Tensor, key: int) -> None:
    hook = _CAPTURES.get(key)
    if hook is not None and hook._capture.enabled:
        hook._capture.capture_output_grad(grad)


@_capture_output_grad_op.register_fake
def _(grad: torch.Tensor, key: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.dkfac.capture_output_grad.default)


class _CapturedOutput(torch.autograd.Function):
    """A compiled forward's layer output, passed on, whose backward feeds the layer's capture the output gradient
    (`part` of it) through dkfac::capture_output_grad. A tensor hook registered on the output from inside the
    compiled region does the same in eager terms, but torch 2.11's Dynamo fails to compile it once a shape is
    dynamic (a second batch size or sequence length: `Node autograd_function_apply referenced nonexistent value
    s77`); this function is applied where the hook stands, in program order. It returns the output detached (the
    same memory, no copy), not a view of it: autograd forbids writing in place to a custom function's view, which
    the model's next operation may do (ReLU(inplace=True), `y += x`); the hook's way failed there the same way."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, key: int, part: Callable) -> torch.Tensor:
        ctx.key, ctx.part = key, part
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        torch.ops.dkfac.capture_output_grad(ctx.part(grad), ctx.key)
        return grad, None, None


class _CaptureHook:
    """A registered layer's forward hook: feeds the layer's capture its input, and its output gradient through a
    tensor hook (under torch.compile, through the custom operators above).

    It captures for the one module object it was registered on: a copy of the model (copy.deepcopy, an EMA or
    swa_utils.AveragedModel copy, a pickled and loaded model) carries the hook along with the module's other
    attributes, and must neither feed this preconditioner's factors nor fail to copy. A copied or unpickled hook
    is inert (it captures nothing); the copy trains with its plain gradients, or with a preconditioner of its own.
    It holds the capture and a weak reference to its module, not the preconditioner: no reference cycle through
    the model. On a tensor-parallel layer (`sliced`) it runs before torch.distributed.tensor.parallel's output
    hook and captures the local parts of the DTensors it sees: its input, whole or this rank's features, and
    its output's gradient, this rank's features or whole (_TensorParallelSlice); with exact factors (`whole`),
    both whole, gathered over the tensor-parallel ranks."""

    def __init__(self, module: torch.nn.Module | None, capture: Any, name: str = '', sliced: bool = False,
                 whole: bool = False, seen: list[bool] | None = None) -> None:
        self._module = weakref.ref(module) if module is not None else None
        self._name = name
        self.sliced = sliced
        self._part = _whole if whole else _local
        self._capture = capture
        # Its weight's shape then: a weight resized in place since (transformers' resize_token_embeddings assigns
        # a larger .data to the same Parameter) is refused here, before its capture meets ids past the old size.
        self._shape = tuple(module.weight.shape) if module is not None else None
        # A Conv1d is captured as the Conv2d of kernel height 1 it is: its input and output gradient with a height.
        self._seen = _with_height if isinstance(module, torch.nn.Conv1d) else _as_is
        self.key = next(_capture_keys)
        self.passes = torch.zeros((), dtype=torch.int64)  # the compiled forward's captures, counted
        self.seen = seen if seen is not None else [False]  # the preconditioner's: a forward pass since its step()
        if capture is not None:
            _CAPTURES[self.key] = self

    def __call__(self, module: torch.nn.Module, args: tuple, *rest: Any) -> torch.Tensor | None:
        # (kwargs, output) as registered (with_kwargs=True); (output,) for an inert hook of a model pickled with a
        # dkfac before 2026-11-30, which torch calls without the keywords.
        capture = self._capture
        if capture is None or self._module is None or self._module() is not module:
            return
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        if not module.training or not torch.is_grad_enabled():
            return
        # The input as forward takes it: first positional, or by keyword (`linear(input=x)`, transformers'
        # Conv1D `x=`), which a hook without kwargs never sees.
        inputs = args if args else tuple(kwargs[k] for k in ('input', 'x') if k in kwargs)[:1]
        if not inputs:
            raise ValueError(f'layer {self._name!r} ({type(module).__name__}) was called without an input dkfac '
                             f'can read: positional arguments {len(args)}, keywords {sorted(kwargs)}')
        if torch.compiler.is_compiling():
            key, part = self.key, (self._part if self.sliced else self._seen)
            torch.ops.dkfac.capture_input(part(inputs[0]), self.passes, key)
            return _CapturedOutput.apply(output, key, part) if output.requires_grad else None
        self.seen[0] = True
        if not capture.enabled:
            return
        self.refuse_resized()
        if self.sliced:  # a tensor-parallel layer: this rank's part of the input and of the output gradient, or all
            part = self._part
            capture.capture_input(part(inputs[0]))
            if output.requires_grad:
                output.register_hook(lambda grad: capture.capture_output_grad(part(grad)))
            return
        if _is_dtensor(inputs[0]):
            raise ValueError(f'layer {self._name!r} ({type(module).__name__}) takes a DTensor input '
                             f'({inputs[0].placements}): it was split by torch.distributed.tensor.parallel after the '
                             'preconditioner was built. Build the preconditioner after parallelize_module')
        seen = self._seen
        capture.capture_input(seen(inputs[0]))
        if output.requires_grad:  # no wrapper on the backward pass where the gradient is taken as it comes
            _on_gradient(output, capture.capture_output_grad if seen is _as_is
                         else lambda grad: capture.capture_output_grad(seen(grad)))

    def refuse_resized(self) -> None:
        """Raises where the module's weight is no longer the shape it had when hooked (resized in place)."""
        module = self._module() if self._module is not None else None
        if module is not None and tuple(module.weight.shape) != self._shape:
            raise ValueError(_resized(self._name, module, self._shape))

    def release(self) -> None:
        """Forgets the capture (the preconditioner went): a compiled graph that still calls it does nothing."""
        _CAPTURES.pop(self.key, None)
        self._capture = None

    def __deepcopy__(self, memo: dict) -> _CaptureHook:
        return _CaptureHook(None, None)

    def __reduce__(self) -> tuple:
        return (_CaptureHook, (None, None))


def _register_first(module: torch.nn.Module, hook: _CaptureHook) -> Any:
    """Registers `hook` as `module`'s first forward hook (with its keyword arguments). torch keeps the hooks in an
    OrderedDict and prepends by moving the new one to the front, which torch.compile's guards do not see: they read
    the dict's insertion order (dict.keys), in which the new one is last, and the guard on its attributes fails
    (AttributeError) where the module already has hooks (torch.distributed.tensor.parallel's, or a user's). The
    others are inserted again after it, so that both orders agree; their handles remove them by key, as before."""
    handle = module.register_forward_hook(hook, prepend=True, with_kwargs=True)
    hooks = module._forward_hooks
    for key in [key for key in hooks if key != handle.id]:
        hooks[key] = hooks.pop(key)
    return handle


class _CoreWarnings:
    """Re-raises the C++ core's warnings (TORCH_WARN) of the calls made inside the block with
    ``warnings.warn``, attributed to the user's line, once the core has returned (it runs with the GIL
    released, so it cannot warn through Python itself). If the block raises, its error is the one that
    propagates, even where a filter turns the warnings into errors."""

    def __enter__(self) -> None:
        self._collector = _C.WarningCollector()
        self._collector.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        collected = self._collector.stop()
        level = _stacklevel_outside_dkfac()
        for message, deprecation in collected:
            category = DeprecationWarning if deprecation else UserWarning
            if error is None:
                warnings.warn(message, category, stacklevel=level)
            else:
                with contextlib.suppress(Warning):
                    warnings.warn(message, category, stacklevel=level)


def _group_timeout(group: Any) -> float:
    """The timeout `group` was made with (init_process_group's or new_group's `timeout`), in seconds: the default of
    the preconditioner's own `timeout`, so that dkfac's collectives give up when the job's do (it was torch's
    default of 30 minutes whatever the group said). torch's default where the group does not tell."""
    for device in ('cpu', 'cuda'):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    return dist.default_pg_timeout.total_seconds()


def _resized(name: str, module: torch.nn.Module, shape: tuple[int, ...]) -> str:
    return (f'layer {name!r} ({type(module).__name__}): its weight is {list(module.weight.shape)} now, '
            f'{list(shape)} when the preconditioner was built (resized in place: resize_token_embeddings, or a new '
            '.data); its K-FAC factors have the old shape. Build the preconditioner (and the optimizer) after '
            'resizing')


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _on_gradient(output: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Calls `hook` with the gradient of a layer's `output`. An output that is the whole of another tensor viewed
    in another shape (a Linear of a 3-D input, transformers' Conv1D: their product's rows, reshaped) takes it on
    that tensor, reshaped as the output: a hook on the view does not fire once the next operation writes the view
    in place (ReLU(inplace=True)), where one on its base does, with the same gradient."""
    base = output._base if output._is_view() else None
    if (base is not None and base.requires_grad and base.numel() == output.numel() and base.is_contiguous()
            and output.is_contiguous() and base.data_ptr() == output.data_ptr()):
        shape = output.shape
        base.register_hook(lambda grad: hook(grad.reshape(shape)))
    else:
        output.register_hook(hook)


def _with_height(t: torch.Tensor) -> torch.Tensor:
    """A Conv1d's input or output gradient ([N, C, L], or [C, L] unbatched) as the Conv2d's of height 1."""
    return t.unsqueeze(-2)


def _kind_not_saved(module: torch.nn.Module) -> str:
    """Why a state dict may lack a layer of this kind, and how to load it, for the kinds kfac_pytorch does not
    register (and a torch.nn.Conv1d, which dkfac registers since 2026-11-30)."""
    kind = type(module).__name__
    if isinstance(module, torch.nn.Conv1d):
        writers = 'kfac_pytorch and dkfac before 2026-11-30 do'
    elif isinstance(module, torch.nn.Embedding) or kind == 'Conv1D':
        writers = 'kfac_pytorch does'
    else:
        return ''
    return (f': {writers} not register a {kind}; to load a state saved without it, build the preconditioner with '
            f"skip_layers=[{kind!r}] (it then keeps its plain gradient)")


def _fsdp1(where: str) -> str:
    return (f'dkfac: {where} wrapped in torch.distributed.fsdp.FullyShardedDataParallel (FSDP1), whose flat '
            "parameters hide each layer's weight from K-FAC: shard the model with FSDP2's fully_shard "
            '(torch.distributed.fsdp.fully_shard, docs/PYTHON.md "Sharded models"), or replicate it with '
            'DistributedDataParallel')


def _fsdp1_flattened(t: Any) -> bool:
    """Whether ``t`` is a layer's parameter as FSDP1 leaves it: flattened into a shard (``use_orig_params=True``),
    or a view of the wrapper's FlatParameter (``use_orig_params=False``)."""
    if getattr(t, '_fsdp_flattened', False):
        return True
    flat = getattr(sys.modules.get('torch.distributed.fsdp._flat_param'), 'FlatParameter', None)
    return flat is not None and isinstance(getattr(t, '_base', None), flat)


def _wrapper_free(name: str) -> str:
    """A layer's name without what torch's wrappers put in its path: DistributedDataParallel's and DataParallel's
    leading ``module``, torch.compile's ``_orig_mod`` and checkpoint_wrapper's ``_checkpoint_wrapped_module``."""
    parts = [part for part in name.split('.') if part not in ('_orig_mod', '_checkpoint_wrapped_module')]
    if len(parts) > 1 and parts[0] == 'module':
        parts = parts[1:]
    return '.'.join(parts)


def _shown(value: Any) -> str:
    return 'a callable' if callable(value) else repr(value)


def _is_dtensor(t: Any) -> bool:
    if t is None or not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)  # as torch.compile traces it, too (a type's name is not)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (waited for, where an asynchronous redistribution made it); else `t`."""
    if _is_dtensor(t):
        t = t.to_local()
    return t.wait() if type(t).__name__ == 'AsyncCollectiveTensor' else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (exact tensor-parallel factors); else `t`. A replicated one is its
    local part, as is the output gradient of an Embedding split by its vocabulary as torch.compile traces it: that
    gradient carries the output's own masked-sum placement (torch's _MaskPartial), whose mask the forward's
    redistribution has released, so gathering it fails while tracing; its local part is the whole gradient, as the
    Replicate one of an eager backward pass is (test_a_compiled_tensor_parallel_model_equals_one_process)."""
    if not _is_dtensor(t):
        return t
    whole_locally = _whole_locally()
    if all(isinstance(p, whole_locally) for p in t.placements):
        return _local(t)
    with torch.no_grad():
        return _local(t.full_tensor())


def _whole_locally() -> tuple[type, ...]:
    """The placements whose local part is the whole tensor, to _whole."""
    from torch.distributed.tensor import Replicate

    try:  # torch 2.11's; a later torch may move or rename it: then its gradients are gathered as any other
        from torch.distributed.tensor.placement_types import _MaskPartial
    except ImportError:
        return (Replicate,)
    return (Replicate, _MaskPartial)


def _split_by_tensor_parallel(module: torch.nn.Module) -> bool:
    """Whether torch.distributed.tensor.parallel split the module (ColwiseParallel, RowwiseParallel, ...): its
    forward hooks are distribute_module's."""
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    return any(getattr(h, '__qualname__', '').startswith('distribute_module.') for h in hooks)


class _TensorParallel(NamedTuple):
    """How tensor parallelism split one layer (_tensor_parallel): 'column' (output features sharded: A is the
    same on every tensor-parallel rank, G this rank's block) or 'row' (input features sharded: A this rank's
    block, G the same everywhere; the bias, replicated, goes with the block of tensor-parallel rank 0). An
    Embedding split by its vocabulary (RowwiseParallel, torchtitan's) is a row layer whose block of its diagonal A
    is exact: each rank's capture counts its tokens among the whole batch's ids (FactorCapture's vocabulary
    slice). docs/MATH.md section 9."""
    style: str
    group: Any          # the tensor-parallel process group
    rank: int           # this rank's place in it
    size: int
    root: int           # the global rank of its place 0
    gathered: tuple     # the weight's placements in what this rank preconditions: Replicate() over FSDP2's dims
    shard_ranks: int    # the data-parallel ranks FSDP2 (or HSDP) shards the layer over; 0: none
    exact: bool         # tensor_parallel_factors='exact': the whole layer on every rank, its factors exact
    uneven: bool        # the ranks' slices differ in size (torch.chunk's split of a dimension tp does not divide)

    def bias_here(self) -> bool:
        """Whether this rank preconditions the layer's bias (a row layer's block-diagonal slice: place 0 only)."""
        return self.style != 'row' or self.rank == 0 or self.exact

    def whole(self) -> bool:
        """Whether every tensor-parallel rank preconditions the whole layer (and one counts it in KL clipping)."""
        return self.exact


def _tensor_parallel(name: str, module: torch.nn.Module, factors: str = 'block_diagonal') -> _TensorParallel | None:
    """The split of a layer by torch.distributed.tensor.parallel, or None for a layer it did not split: the
    tensor-parallel dimension is the mesh's last (fully_shard puts its own dimensions before it). `factors`:
    tensor_parallel_factors. A split dkfac cannot precondition (a replicated weight, a vocabulary-sharded Embedding,
    another placement) is refused, naming the layer."""
    if not _split_by_tensor_parallel(module):
        return None
    weight = module.weight
    what = f'layer {name!r} ({type(module).__name__}), split by torch.distributed.tensor.parallel'
    if not _is_dtensor(weight):
        raise ValueError(f'{what}, has a weight that is not a DTensor')
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = weight.device_mesh, weight.placements
    *data_parallel, placement = placements
    if not all(isinstance(p, Replicate) or (isinstance(p, (Shard, _StridedShard)) and p.dim == 0)
               for p in data_parallel):
        raise ValueError(f'{what}, is placed as {placements} over its mesh: dkfac expects fully_shard\'s row '
                         'sharding (or replication) before the tensor-parallel dimension')
    # Which weight dimension holds the output features (G's side) and which the input features (A's side).
    out_dim, in_dim = (1, 0) if isinstance(module, torch.nn.Embedding) else (0, 1)
    if isinstance(placement, Replicate):
        # SequenceParallel's: the layer runs on this rank's share of the sequence, so its gradient and factors are
        # partial sums over the tensor-parallel ranks.
        raise ValueError(f'{what}, has its weight replicated over the tensor-parallel ranks ({placement}: '
                         'SequenceParallel), so its gradient is a partial sum over them: dkfac cannot precondition '
                         'it yet; leave the layer to the optimizer (skip_layers)')
    if type(placement) is Shard and placement.dim in (out_dim, in_dim):
        style = 'column' if placement.dim == out_dim else 'row'
    else:
        raise ValueError(f'{what}, has its weight placed as {placement}, which dkfac cannot precondition: leave the '
                         'layer to the optimizer (skip_layers)')
    exact = factors == 'exact'
    tp = mesh.ndim - 1
    # Every rank's slice, as torch.chunk splits the sharded dimension (DTensor's Shard does): the same on each rank,
    # so that each refuses the same split before any collective.
    slices = [len(c) for c in torch.arange(weight.shape[placement.dim]).chunk(mesh.size(tp))]
    slices += [0] * (mesh.size(tp) - len(slices))
    if 0 in slices:
        raise ValueError(f'{what}, is split into slices of {slices} {"output" if style == "column" else "input"} '
                         f'features over {mesh.size(tp)} tensor-parallel ranks: an empty slice has nothing to '
                         f'precondition. Give it a number of them that {mesh.size(tp)} divides, or leave it to the '
                         'optimizer (skip_layers)')
    group = mesh.get_group(tp)
    shard_ranks = 1
    for d, p in enumerate(data_parallel):
        if not isinstance(p, Replicate):
            shard_ranks *= mesh.size(d)
    gathered = (Replicate(),) * tp + (Replicate() if exact else placement,)
    return _TensorParallel(style, group, mesh.get_local_rank(tp), mesh.size(tp), dist.get_global_rank(group, 0),
                           gathered, shard_ranks if shard_ranks > 1 else 0, exact, len(set(slices)) > 1)


def _is_sharded(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a layer's Parameters are DTensors (FSDP2's ``fully_shard``, HSDP)."""
    sharded = [_is_dtensor(t) for t in (weight, bias) if t is not None]
    if any(sharded) and not all(sharded):
        raise ValueError('a layer whose weight and bias are not both DTensors (or both plain tensors) cannot be '
                         'preconditioned')
    return any(sharded)


class _Distributor:
    """How one layer's gradient reaches the core's step and returns from it, for one parallelism (the core calls
    them through ``Preconditioner::step``'s Distributor, docs/ARCHITECTURE.md). What the core binds for the layer
    (`core_tensors`); what the rank gathers before the core's step (`start_gather`: the collectives' works, then
    `finish_gather` once they were waited for) and returns after it (`start_scatter`, `finish_scatter`). Each
    start adds to `moved` the collectives it ran and the gradient bytes this rank sent or received (a chunk's
    padding not counted), which the core counts as gradient traffic.

    This one is data-parallel replication (DDP, or one process): the core binds the layer's Parameters, whose
    gradients DDP already averaged, and nothing moves."""

    shard_ranks = 0  # the ranks a sharded layer's rows are split over; 0: not sharded
    moves = False  # whether it fills stand-ins around the core's step

    def __init__(self) -> None:
        self.moved = [0, 0]  # calls, bytes

    def core_tensors(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return weight, bias

    def start_gather(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        return []

    def finish_gather(self) -> None:
        pass

    def start_scatter(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        return []

    def finish_scatter(self) -> None:
        pass


class _StandIns(_Distributor):
    """A distributor whose layer the core sees through stand-ins (`stand_ins`, for the weight and the bias or
    None): leaves of the shape the core preconditions over one element (zero strides), whose .grad the gather fills
    and the scatter empties. The core reads their shape, dtype, device and requires_grad (a layer frozen later is
    named so), and their .grad."""

    moves = True
    stand_ins: list[torch.Tensor | None]

    @staticmethod
    def _stand_in(t: torch.Tensor, shape: Any) -> torch.Tensor:
        """A stand-in of `shape` for the DTensor parameter `t` (its dtype, device and requires_grad)."""
        return torch.empty_strided(shape, [0] * len(shape), dtype=t.dtype,
                                   device=t.to_local().device).requires_grad_(t.requires_grad)

    def core_tensors(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return tuple(self.stand_ins)

    def follow_requires_grad(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """A parameter frozen (or unfrozen) since the stand-ins were made: theirs follows, at each step(), so that
        the core sees the layer frozen as for an unsharded one (it used to keep the stand-in's first value, and a
        weight frozen with its gradient zeroed in place was preconditioned and moved)."""
        for parameter, stand_in in zip((weight, bias), self.stand_ins):
            if stand_in is not None and parameter is not None and stand_in.requires_grad != parameter.requires_grad:
                stand_in.requires_grad_(parameter.requires_grad)


class _ReplicatedShards(_StandIns):
    """A layer sharded by FSDP2 or HSDP, replicated placement (``sharded_placement='replicated'``): the core
    preconditions full-shaped stand-ins. Before the core's step every rank all-gathers each such gradient
    (``full_tensor()``: FSDP2 left it reduce-scattered, averaged over the data-parallel ranks as DDP averages it)
    into its stand-in; after it, each rank copies its own rows of the preconditioned gradient back into its shard.
    Factors come from the hooks as for DDP (each rank's full local activations and output gradients) and are
    reduced over every rank, so the job equals the same one under DDP (docs/STRATEGIES.md, "Sharded models").
    K-FAC memory is that of the strategy under DDP, plus the full gradients of every sharded layer, gathered
    before the core's step and freed after it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard

        self.shard_ranks = 1
        for d, p in enumerate(weight.placements):
            if isinstance(p, Shard):
                self.shard_ranks *= weight.device_mesh.size(d)
        self.stand_ins = [None if t is None else self._stand_in(t, t.shape) for t in (weight, bias)]  # full-shaped

    def start_gather(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        for parameter, stand_in in zip((weight, bias), self.stand_ins):
            if stand_in is None:
                continue
            stand_in.grad = None if parameter.grad is None else parameter.grad.full_tensor()
            if stand_in.grad is not None:  # the rows this rank lacked
                local = parameter.grad.to_local()
                self.moved[0] += 1
                self.moved[1] += (stand_in.grad.numel() - local.numel()) * stand_in.grad.element_size()
        return []

    def start_scatter(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for parameter, stand_in in zip((weight, bias), self.stand_ins):
            if stand_in is None or stand_in.grad is None or parameter.grad is None:
                continue
            grad = parameter.grad
            shape, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
            rows = stand_in.grad[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            grad.to_local().copy_(rows)
            stand_in.grad = None
        return []


class _OwnerShards(_StandIns):
    """A layer sharded by FSDP2 or HSDP, owner placement (``sharded_placement='owner'``): before the core's step
    each rank of the layer's shard group sends its rows of the gradient to the layer's owner there (one
    ``gather``, each shard padded to ``torch.chunk``'s size as FSDP2 splits rows), which preconditions the whole
    gradient; after it, the owner sends each rank its rows back (one ``scatter``). The other ranks hold nothing of
    the layer but their rows: the core keeps its factors and second-order state with the owner
    (strategy::LayerFlow::owner_rows).

    What the owner preconditions is what the layer's distributor under the replicated placement (`placed`) binds
    the core to: the whole layer (_ReplicatedShards), or under tensor parallelism this rank's slice
    (_TensorParallelSlice, block-diagonal factors), whose rows FSDP2 splits as it splits a whole layer's. A row
    layer's bias, which every tensor-parallel rank holds, is preconditioned by the owner among place 0's ranks and
    sent from there to the other tensor-parallel ranks once it is back."""

    def __init__(self, placed: _StandIns, owner: int, group: Any, me: int) -> None:
        _Distributor.__init__(self)
        self.placed = placed  # the replicated placement's distributor, whose stand-ins the core is bound to
        self.stand_ins, self.shard_ranks = placed.stand_ins, placed.shard_ranks
        self.owner, self.group, self.mine = owner, group, owner == me
        self.size = dist.get_world_size(group)
        self.split = getattr(placed, 'split', None)

    def _chunk(self, stand_in: torch.Tensor) -> int:
        """The rows of a whole chunk of what the core preconditions, as FSDP2 splits them."""
        return -(-stand_in.shape[0] // self.size)

    def _count(self, stand_in: torch.Tensor, local: torch.Tensor, chunk: int) -> None:
        """One collective of this layer's rows: the owner receives (or sends) every other rank's real rows, another
        rank sends (or receives) its own."""
        rows = stand_in.shape[0]
        theirs = rows - min(chunk, rows - min(rows, dist.get_group_rank(self.group, self.owner) * chunk))
        self.moved[0] += 1
        self.moved[1] += (theirs if self.mine else local.shape[0]) * stand_in.shape[1:].numel() * local.element_size()

    def start_gather(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        works = []
        self.received = []
        for parameter, stand_in in zip((weight, bias), self.stand_ins):
            if stand_in is None:
                continue
            grad = _placed_as(parameter)  # as FSDP2 places it already (a vocabulary-split Embedding's too)
            if grad is None:  # FSDP2 leaves it None on every rank alike: the core's unused-layer policy
                continue
            local, chunk = grad.to_local(), self._chunk(stand_in)
            padded = local.new_zeros((chunk, *local.shape[1:]))
            padded[:local.shape[0]].copy_(local)
            chunks = [torch.empty_like(padded) for _ in range(self.size)] if self.mine else None
            works.append(dist.gather(padded, chunks, dst=self.owner, group=self.group, async_op=True))
            self._count(stand_in, local, chunk)
            self.received.append((stand_in, chunks))
        return works

    def finish_gather(self) -> None:
        for stand_in, chunks in self.received:
            if self.mine:
                stand_in.grad = torch.cat(chunks)[:stand_in.shape[0]]
            else:  # the core reads only that the layer has a gradient here: one value, no memory
                stand_in.grad = torch.zeros((), dtype=stand_in.dtype, device=stand_in.device).expand(stand_in.shape)
        self.received = []

    def start_scatter(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        works = []
        self.returned = []
        for parameter, stand_in in zip((weight, bias), self.stand_ins):
            if stand_in is None or parameter.grad is None:
                continue
            local, chunk = parameter.grad.to_local(), self._chunk(stand_in)
            chunks = None
            if self.mine:
                whole = stand_in.grad.new_zeros((chunk * self.size, *stand_in.shape[1:]))
                whole[:stand_in.shape[0]].copy_(stand_in.grad)
                chunks = list(whole.split(chunk))
            rows = local.new_empty((chunk, *local.shape[1:]))
            works.append(dist.scatter(rows, chunks, src=self.owner, group=self.group, async_op=True))
            self._count(stand_in, local, chunk)
            self.returned.append((local, rows, stand_in))
        self.row_bias = bias if self.split is not None and self.split.style == 'row' and bias is not None \
            and bias.grad is not None else None
        return works

    def finish_scatter(self) -> None:
        for local, rows, stand_in in self.returned:
            local.copy_(rows[:local.shape[0]])
            stand_in.grad = None
        self.returned = []
        if self.row_bias is not None:  # back on place 0's ranks: each sends its rows to its tensor-parallel peers
            local = self.row_bias.grad.to_local()
            self.moved[0] += 1
            self.moved[1] += local.numel() * local.element_size() * (self.split.size - 1 if self.split.rank == 0
                                                                      else 1)
            dist.broadcast(local, src=self.split.root, group=self.split.group)
            self.row_bias = None


class _TensorParallelSlice(_StandIns):
    """A layer split by tensor parallelism (_TensorParallel): the core preconditions this rank's slice as a layer
    of its own, bound to stand-ins of the slice's shapes. Its factors are reduced over the data-parallel group
    only; nothing moves between tensor-parallel ranks but a row layer's bias gradient, which place 0
    preconditions with its block and broadcasts to the others after the core's step (their bias gradients are the
    same before it). Alone, the slice's gradients are the local gradients themselves (the core writes them in
    place); under fully_shard each is all-gathered over FSDP2's dimensions before the core's step and its rows
    taken back after it, as _ReplicatedShards does for a whole layer. With exact factors every rank gathers and
    preconditions the whole layer (over the tensor-parallel dimension too) and keeps its own part."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, split: _TensorParallel) -> None:
        super().__init__()
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.split = split
        self.shard_ranks = split.shard_ranks  # the plan prices the data-parallel gather (not the tensor-parallel one)
        self._gathers = bool(split.shard_ranks) or split.exact
        self.stand_ins = []
        for t in (weight, bias if split.bias_here() else None):
            if t is None:
                self.stand_ins.append(None)
                continue
            shape, _ = compute_local_shape_and_global_offset(t.shape, t.device_mesh, self._gathered(t))
            self.stand_ins.append(self._stand_in(t, shape))

    def _gathered(self, t: torch.Tensor) -> tuple:
        """The placements of what this rank preconditions of `t`: replicated over FSDP2's dimensions, and over the
        tensor-parallel one as `t` is (its slice), or replicated (exact factors: the whole layer)."""
        return self.split.gathered[:-1] + (self.split.gathered[-1] if self.split.exact else t.placements[-1],)

    def start_gather(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        for parameter, stand_in in zip((weight, bias), self.stand_ins):
            if stand_in is None:
                continue
            grad = _placed_as(parameter)
            if grad is None or not self._gathers:
                stand_in.grad = None if grad is None else self._local_part(grad)
                continue
            stand_in.grad = grad.redistribute(grad.device_mesh, self._gathered(grad)).to_local()
            self.moved[0] += 1
            self.moved[1] += (stand_in.grad.numel() - grad.to_local().numel()) * stand_in.grad.element_size()
        return []

    @staticmethod
    def _local_part(grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of `grad`, which the core preconditions in place. A write to the DTensor (a backward pass
        accumulating into it, zero_grad(set_to_none=False)) moves the DTensor's version and not its local tensor's,
        which the core reads to tell a new gradient from the one its last step() wrote: its version is moved at
        every step, and a second step() without a backward pass is told from the DTensor's own version
        (BaseKFACPreconditioner._refuse_repeated_step), as for gathered gradients."""
        local = grad.to_local()
        torch.autograd.graph.increment_version(local)
        return local

    def start_scatter(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        from torch.distributed.tensor import DTensor

        for parameter, stand_in in zip((weight, bias), self.stand_ins):
            if stand_in is None:
                continue
            grad = parameter.grad
            if self._gathers and grad is not None and stand_in.grad is not None:  # this rank's part, no traffic
                whole = DTensor.from_local(stand_in.grad, grad.device_mesh, self._gathered(grad), run_check=False)
                grad.to_local().copy_(whole.redistribute(grad.device_mesh, grad.placements).to_local())
            stand_in.grad = None  # alone, the core wrote the local gradients themselves
        if self.split.style != 'row' or self.split.exact or bias is None or bias.grad is None:
            return []
        local = bias.grad.to_local()
        self.moved[0] += 1
        self.moved[1] += local.numel() * local.element_size() * (self.split.size - 1 if self.split.rank == 0 else 1)
        return [dist.broadcast(local, src=self.split.root, group=self.split.group, async_op=True)]


def _placed_as(parameter: torch.Tensor) -> torch.Tensor | None:
    """A DTensor parameter's gradient, placed as the parameter is. torch's embedding backward leaves the gradient of
    an Embedding split by its vocabulary (weight Shard(0)) replicated, every rank holding every token's rows: it is
    replaced by this rank's rows (a local slice, no communication), the gradient the optimizer would take, so that
    what dkfac writes is the whole of it and no rank keeps other ranks' rows unpreconditioned."""
    grad = parameter.grad
    if grad is not None and _is_dtensor(grad) and tuple(grad.placements) != tuple(parameter.placements):
        grad = parameter.grad = grad.redistribute(grad.device_mesh, parameter.placements)
    return grad


def _distributor(weight: torch.Tensor, bias: torch.Tensor | None, was: _Distributor | None = None,
                 owner: tuple[int, Any, int] | None = None, split: _TensorParallel | None = None) -> _Distributor:
    """The one place a layer's distributor is chosen, from its Parameters and its placement: a layer split by
    tensor parallelism (`split`), its slice (_TensorParallelSlice); plain tensors, data-parallel replication
    (_Distributor); DTensors, the owner placement where the plan gave the layer an owner (`owner`: its global rank,
    the shard group, this rank; _OwnerShards), else the replicated placement (_ReplicatedShards). A sharded layer
    keeps the stand-ins of the distributor it `was` (the core is bound to them). Owner placement applies to a
    sharded layer and to a slice that FSDP2 shards (_OwnerShards around the replicated placement's distributor)."""
    if isinstance(was, _OwnerShards):
        was = was.placed
    if split is not None:
        placed = was if isinstance(was, _TensorParallelSlice) else _TensorParallelSlice(weight, bias, split)
    elif not _is_sharded(weight, bias):
        return _Distributor()
    else:
        placed = was if isinstance(was, _ReplicatedShards) else _ReplicatedShards(weight, bias)
    return placed if owner is None else _OwnerShards(placed, *owner)


def _shard_group(parameter: torch.Tensor, split: _TensorParallel | None = None) -> tuple[Any, int]:
    """The process group a DTensor parameter's rows are sharded over (FSDP2's Shard(0) mesh dimension), and how
    many replicas of that sharding the mesh holds (HSDP's replicate dimension; 1 for FSDP). For a layer split by
    tensor parallelism (`split`), over the mesh's dimensions before the tensor-parallel one, the last (FSDP2 shards
    a column layer's slice with a _StridedShard(0) there)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = parameter.device_mesh, parameter.placements
    if split is not None:
        placements = placements[:-1]
    dims = [d for d, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))]
    if len(dims) != 1 or placements[dims[0]].dim != 0 or not all(
            isinstance(p, (Replicate, Shard, _StridedShard)) for p in placements):
        raise ValueError(f'sharded_placement=owner needs parameters sharded by rows (Shard(0)) over one mesh '
                         f'dimension, as fully_shard does by default; got placements {placements}')
    replicas = 1
    for d, p in enumerate(placements):
        if isinstance(p, Replicate):
            replicas *= mesh.size(d)
    return mesh.get_group(dims[0]), replicas


class BaseKFACPreconditioner:
    """K-FAC preconditioner over layers already chosen, as kfac_pytorch's ``BaseKFACPreconditioner``.

    ``layers`` maps each ``torch.nn.Module`` to ``(name, capture)``, in model order, where ``capture`` is
    the core's ``dkfac._C.linear_capture(...)`` or ``dkfac._C.conv2d_capture(...)`` for that module (in
    kfac_pytorch, a ``KFACBaseLayer``); the module's ``weight`` and ``bias`` are preconditioned.
    ``options`` holds the core's other options, as ``KFACPreconditioner`` builds them (the counterpart
    of kfac_pytorch's required ``assignment`` and ``tdc``). ``process_group``: a torch.distributed group of
    more than one rank (backend gloo, nccl or cpu:gloo,cuda:nccl; dkfac's own subgroups use the same
    backends) for distributed K-FAC (every rank builds its preconditioner with the same layers and options),
    or None; ``timeout``: seconds for dkfac's own subgroups (default: torch's); ``model_parallel_group``: where
    ``layers`` are one part of each replica's model (a pipeline stage built by ``torch.distributed.pipelining``),
    the group of the ranks holding its other parts, over which KL clipping sums sum(V * grad), so that every part
    scales by the whole model's nu (``process_group`` is then the part's data-parallel group; layers split by
    torch.distributed.tensor.parallel add their tensor-parallel group to it, ``tensor_parallel_factors`` saying
    whether each rank preconditions its slice, 'block_diagonal', or the whole layer, 'exact'). The hyper-parameters,
    ``accumulation_steps``, ``update_factors_in_hook``, ``defaults`` (extra entries of ``repr()``) and
    ``loglevel`` have kfac_pytorch's meanings. Most code builds a ``KFACPreconditioner`` instead.
    """

    _retired: str = ''  # why step() raises, once another preconditioner took its layers over (_take_over)
    _supersedes: tuple = ()  # (weak reference, layer) of those it takes over at its first step(); a list once built

    def __init__(
        self,
        layers: dict[torch.nn.Module, tuple[str, Any]],
        *,
        options: dict[str, Any],
        process_group: Any = None,
        timeout: float | None = None,
        model_parallel_group: Any = None,
        tensor_parallel_factors: str = 'block_diagonal',
        factor_update_steps: Callable[[int], int] | int = _default('factor_update_steps'),
        inv_update_steps: Callable[[int], int] | int = _default('inv_update_steps'),
        damping: Callable[[int], float] | float = _default('damping'),
        factor_decay: Callable[[int], float] | float = _default('factor_decay'),
        kl_clip: Callable[[int], float] | float | None = _default('kl_clip'),
        lr: Callable[[int], float] | float = _default('lr'),
        accumulation_steps: int = _default('accumulation_steps'),
        update_factors_in_hook: bool = _default('update_factors_in_hook'),
        defaults: dict[str, Any] | None = None,
        loglevel: int = logging.DEBUG,
    ) -> None:
        hyper = {name: _hyper_value(name, value) for name, value in dict(
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps, damping=damping,
            factor_decay=factor_decay, kl_clip=kl_clip, lr=lr, accumulation_steps=accumulation_steps).items()}
        _C.option_values(dict(hyper, update_factors_in_hook=update_factors_in_hook))  # checked as declared, named
        factor_update_steps, inv_update_steps, damping, factor_decay, kl_clip, lr, accumulation_steps = hyper.values()
        if kl_clip is None:
            kl_clip = 0.0  # dkfac: None or 0 turns KL clipping off
        if not isinstance(layers, dict) or not layers:
            raise ValueError(f'layers must be a non-empty dict {{module: (name, capture)}}, got {layers!r:.200}')

        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self._accumulation_steps = accumulation_steps
        self._update_factors_in_hook = update_factors_in_hook
        self._defaults = defaults
        self._loglevel = loglevel
        self._layers = dict(layers)
        self._names = [name for name, _ in self._layers.values()]
        self._modules = list(self._layers)
        self._captures = [capture for _, capture in self._layers.values()]
        if model_parallel_group is not None and not isinstance(model_parallel_group, dist.ProcessGroup):
            raise TypeError('model_parallel_group must be a torch.distributed ProcessGroup (the ranks holding the '
                            f'model\'s other parts) or None, got {type(model_parallel_group).__name__}')
        if tensor_parallel_factors not in ('block_diagonal', 'exact'):
            raise ValueError("tensor_parallel_factors must be 'block_diagonal' or 'exact', got "
                             f'{tensor_parallel_factors!r}')
        self._model_group = (model_parallel_group if model_parallel_group is not None
                             and dist.get_world_size(model_parallel_group) > 1 else None)
        _MODEL_PARTS[:] = [(ref, group) for ref, group in _MODEL_PARTS if ref() is not None]
        if self._model_group is not None:
            if any(group is self._model_group for _, group in _MODEL_PARTS):
                warnings.warn('dkfac: another preconditioner on this rank already sums KL clipping over this '
                              'model_parallel_group. If both hold stages of one pipeline (an interleaved or looped '
                              "schedule), build one preconditioner per rank over all of its stages' modules "
                              '(torch.nn.ModuleList([...])): one per stage pairs the stages wrongly in the sum',
                              stacklevel=_stacklevel_outside_dkfac())
            _MODEL_PARTS.append((weakref.ref(self), self._model_group))
        self._world_size = dist.get_world_size(process_group) if process_group is not None else 1
        self._rank = dist.get_rank(process_group) if process_group is not None else 0
        # How errors that number process_group's ranks (a difference at construction, a lost rank) map to global
        # ranks, where they differ.
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else []
        self._global_ranks = f" (process_group's rank i is global rank {ranks}[i])" if ranks != list(
            range(len(ranks))) else ''
        self._communicator = self._make_communicator(process_group, timeout) if self._world_size > 1 else None
        if self._communicator is not None:
            # Its heartbeat watchdog (which names a lost rank in a failed collective's error) stops as a clean end
            # when this preconditioner goes, or at the interpreter's exit, before torch's store does.
            weakref.finalize(self, self._communicator.stop_watchdog)

        # A preconditioner still hooked to these layers (one a framework holds: Lightning's tuner, an earlier fit's
        # optimizer) is retired at this one's first step() (_take_over), not refused: its step() then raises. Not
        # before: a build refused later (dkfac.optim.KFAC's checks of its base optimizer) or a preconditioner built
        # and dropped without a step (to read memory_usage(), say) leaves it as it was.
        previous: dict[torch.nn.Module, weakref.ref] = {}
        self._supersedes: list[tuple[weakref.ref, str]] = []
        for module, (name, _) in self._layers.items():
            other = _PRECONDITIONED.get(module)
            if other is None or other() is None:
                continue
            previous[module] = other
            if all(ref() is not other() for ref, _ in self._supersedes):
                self._supersedes.append((other, f'{name!r} ({type(module).__name__})'))
                self._supersedes += other()._supersedes  # those it had yet to take over
        owner = weakref.ref(self)
        core_options: dict[str, Any] = {name: (lambda step, a='_' + name: _read(owner, a, step)) for name in _SCHEDULED}
        core_options.update(options, accumulation_steps=accumulation_steps,
                            update_factors_in_hook=bool(update_factors_in_hook))
        self._bound = [(module.weight, getattr(module, 'bias', None)) for module in self._modules]
        self._shapes = [tuple(module.weight.shape) for module in self._modules]  # a resize in place is refused
        # How each layer's gradient reaches the core's step (_distributor): the Parameters themselves, for a layer
        # sharded by FSDP2 (DTensors) full-shaped stand-ins whose gradients step() gathers and scatters back, for a
        # tensor-parallel one its local slice.
        self._splits = [_tensor_parallel(name, module, tensor_parallel_factors)
                        for name, module in zip(self._names, self._modules)]
        self._counted_elsewhere = self._join_tensor_parallel(process_group, model_parallel_group)
        exact = any(split is not None and split.exact for split in self._splits)
        strategy = str(options.get('strategy')).lower()
        # Slices whose shapes differ between the tensor-parallel ranks: a split the size does not divide, or a row
        # layer's bias, which place 0's block carries. DP-KFAC (given, or picked by auto) places the layers by their
        # costs on each rank's own group, and builds each layer's factors from its owner's batch alone: the layers
        # every rank holds whole would get different owners, and different gradients, on each.
        unequal = [(name, 'slices of different sizes' if split.uneven else "a row-parallel layer's bias, which "
                    "tensor-parallel place 0's slice carries") for name, split, module
                   in zip(self._names, self._splits, self._modules)
                   if split is not None and not split.exact
                   and (split.uneven or (split.style == 'row' and getattr(module, 'bias', None) is not None))]
        if strategy in ('dp', 'auto') and unequal:
            name, why = unequal[0]
            raise ValueError(f"strategy={strategy!r} with tensor-parallel slices whose shapes differ between the "
                             f"tensor-parallel ranks (layer {name!r}: {why}): "
                             + ('auto may pick DP-KFAC, which ' if strategy == 'auto' else 'DP-KFAC ')
                             + "places the layers by their costs on each tensor-parallel rank's data-parallel group "
                             "and builds each layer's factors from its owner's batch alone, so the layers every "
                             "tensor-parallel rank holds whole would get different owners and different gradients "
                             "on each; choose 'kaisa' or 'spd', tensor_parallel_factors='exact', or slices of one "
                             "shape (a split the tensor-parallel size divides, row-parallel layers without a bias)")
        if options.get('sharded_placement') == 'owner' and exact:
            raise ValueError("sharded_placement='owner' with tensor_parallel_factors='exact': an owner preconditions "
                             "its data-parallel group's rows of one tensor-parallel slice; use 'block_diagonal' "
                             "factors, or the 'replicated' placement for exact ones")
        self._slice_vocabularies()
        self._distributors = [_distributor(weight, bias, split=split) for (weight, bias), split
                              in zip(self._bound, self._splits)]
        self._owners: list[tuple[int, Any, int] | None] = [None] * len(self._distributors)  # _place_owners
        # A slice's state is this rank's alone: its own name in state dicts (DCP writes each name once).
        self._state_names = [name if split is None or split.whole()
                             else f'{name} (tensor-parallel slice {split.rank} of {split.size})'
                             for name, split in zip(self._names, self._splits)]
        core_layers = [(name, type(module).__name__, *distributor.core_tensors(weight, bias), capture)
                       for (module, (name, capture)), (weight, bias), distributor
                       in zip(self._layers.items(), self._bound, self._distributors)]
        owner_placed = self._owner_placed = options.get('sharded_placement') == 'owner' and self._world_size > 1
        if owner_placed:
            self._owner_grid(core_options, process_group)
        with _CoreWarnings():
            try:
                self._core = _C.Preconditioner(core_layers, core_options, self._communicator,
                                               shard_ranks=[d.shard_ranks for d in self._distributors])
            except RuntimeError as error:  # the core names a subgroup's ranks as the group numbers them
                if 'the ranks built their preconditioners differently' not in str(error) or not self._global_ranks:
                    raise
                raise RuntimeError(f'{error}{self._global_ranks}') from error
        for index in range(len(self._distributors)):
            self._watch_weight(index)
        if owner_placed:
            self._place_owners(process_group)
        if strategy == 'auto' and self._model_group is not None:  # one pick for the model's parts
            self._core.agree_strategy_over_model(leader=dist.get_rank(self._model_group) == 0)
        # After process_group's own comparison (in the core), which names a difference between replicas first.
        self._agree_across_model_parts(options, tensor_parallel_factors)
        for (name, module), (a, g, a_diagonal, g_diagonal) in zip(self.layers, self._core.layer_dims()):
            logger.log(loglevel, 'dkfac: registered %s (%s): A %s, G %s', name, type(module).__name__,
                       f'{a} diagonal' if a_diagonal else f'{a} x {a}', f'{g} diagonal' if g_diagonal else f'{g} x {g}')
        hooks, capture_hooks = [], []
        # Set by any hooked forward pass (eager) since the last step(): an interval assigned after it does not arm the
        # captures again (the step's passes ran as armed).
        self._forward_seen = [False]
        for (module, (name, capture)), split in zip(self._layers.items(), self._splits):
            # Once the core accepted them: a failure leaves no hooks. Each runs before the module's other forward
            # hooks, so that its output is the one the weight's gradient comes from: a hook registered before that
            # returns another output (o * 2) would otherwise hand on its gradient (G 4x off), and a tensor-parallel
            # layer's distribute_module output hook a whole output or a sequence shard of it.
            capture_hooks.append(_CaptureHook(module, capture, name, sliced=split is not None,
                                              whole=split is not None and split.exact, seen=self._forward_seen))
            hooks.append(_register_first(module, capture_hooks[-1]))
            _PRECONDITIONED[module] = owner
        # A preconditioner that goes leaves its modules as it found them, free for another one.
        self._release_hooks = weakref.finalize(self, _release, hooks, capture_hooks, list(self._layers), owner,
                                               previous)
        _WATCHING.add(self)
        if not _OPTIMIZER_HOOK:
            _OPTIMIZER_HOOK.append(register_optimizer_step_post_hook(_optimizer_stepped))
        logger.log(loglevel, 'dkfac: %s', self._core.describe())

    def _slice_vocabularies(self) -> None:
        """An Embedding whose vocabulary tensor parallelism split (a row split, block-diagonal factors): its capture
        counts this rank's tokens [first, first + rows) among every id the layer is given (each rank sees them
        all), so that its diagonal A is the whole layer's block, exactly."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for module, capture, split in zip(self._modules, self._captures, self._splits):
            if split is None or split.style != 'row' or split.exact or not isinstance(module, torch.nn.Embedding):
                continue
            rows, first = compute_local_shape_and_global_offset(module.weight.shape, module.weight.device_mesh,
                                                                split.gathered)
            capture.set_vocabulary_slice(first[0], rows[0])

    def _join_tensor_parallel(self, process_group: Any, model_parallel_group: Any) -> list[bool]:
        """For a model split by tensor parallelism: checks that ``process_group`` (factor reduction, the strategy)
        holds no other tensor-parallel rank, and has KL clipping sum over the tensor-parallel group (or the given
        ``model_parallel_group``, which must hold it). Returns the layers another tensor-parallel rank counts in
        that sum: those it holds whole, which place 0 counts (empty where there is no tensor parallelism)."""
        splits = [(name, split) for name, split in zip(self._names, self._splits) if split is not None]
        if not splits:
            return []
        tp_ranks = sorted(dist.get_process_group_ranks(splits[0][1].group))
        for name, split in splits:
            if sorted(dist.get_process_group_ranks(split.group)) != tp_ranks:
                raise ValueError(f'layers {splits[0][0]!r} and {name!r} are split over different tensor-parallel '
                                 f'groups (ranks {tp_ranks} and {sorted(dist.get_process_group_ranks(split.group))})')
        me = dist.get_rank()
        if process_group is not None:
            peers = sorted(set(dist.get_process_group_ranks(process_group)) & set(tp_ranks) - {me})
            if peers:
                raise ValueError(f'layer {splits[0][0]!r} is split by tensor parallelism over ranks {tp_ranks}, and '
                                 f'process_group holds ranks {peers} of them: pass process_group=the data-parallel '
                                 "group (the ranks holding the same slices: e.g. mesh['dp'].get_group() of a "
                                 "('dp', 'tp') DeviceMesh)")
        if model_parallel_group is None:
            self._model_group = splits[0][1].group
        elif not set(tp_ranks) <= set(dist.get_process_group_ranks(model_parallel_group)):
            raise ValueError(f'model_parallel_group must hold the tensor-parallel ranks {tp_ranks} (KL clipping sums '
                             'over every part of the model)')
        first = splits[0][1].rank == 0
        return [not first and (split is None or split.whole()) for split in self._splits]

    def _agree_across_model_parts(self, options: dict[str, Any], tensor_parallel_factors: str) -> None:
        """The model's parts (the tensor-parallel ranks, and the stages of ``model_parallel_group``) sum KL
        clipping's terms together and precondition the layers they all hold alike: each part's preconditioner must
        have the same options (process_group's ranks compare theirs in the core). One gather over that group at
        construction; every rank raises, naming the first difference. Layer names and name patterns may differ.
        A part without a tensor-parallel layer beside parts with one is refused too: it would count its layers once
        per tensor-parallel rank in the sum."""
        group = self._model_group
        if group is None:
            return
        mine = {key: value for key, value in sorted(options.items())
                if key not in ('skip_layers', 'shared_input_layers', 'spd_fusion', 'grad_scale')}
        for name in _SCHEDULED:  # a schedule by its first value
            value = getattr(self, '_' + name)
            mine[name] = value(0) if callable(value) else value
        mine['accumulation_steps'] = self._accumulation_steps
        mine['tensor_parallel_factors'] = tensor_parallel_factors
        mine['tensor-parallel layers'] = any(split is not None for split in self._splits)
        everyone: list[Any] = [None] * dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        split = next((split for split in self._splits if split is not None), None)
        peers = sorted(dist.get_process_group_ranks(split.group)) if split is not None else [dist.get_rank()]
        try:
            dist.all_gather_object(everyone, ({k: repr(v) for k, v in mine.items()}, self._state_names, peers),
                                   group=group)
        except RuntimeError as error:
            raise RuntimeError(f"dkfac: comparing the options of the model's parts (ranks {ranks}) failed: another "
                               f"part's preconditioner was not built (its error says why): {error}") from error
        self._warn_of_names_in_two_parts(ranks, [(names, set(tp)) for _, names, tp in everyone])
        everyone = [options for options, _, _ in everyone]
        for key in mine:
            values = [theirs.get(key) for theirs in everyone]
            if len(set(values)) == 1:
                continue
            other = next(i for i, v in enumerate(values) if v != values[0])
            if key == 'tensor-parallel layers':
                if not mine['kl_clip']:  # no sum across the parts: nothing counted twice
                    continue
                holds = [ranks[i] for i, v in enumerate(values) if v == repr(True)]
                raise ValueError(f'ranks {holds} of the model\'s parts (ranks {ranks}) hold tensor-parallel layers '
                                 'and the others none: KL clipping would count a part without them once per '
                                 'tensor-parallel rank. Give every pipeline stage a tensor-parallel layer, or build '
                                 'the preconditioners with kl_clip=None')
            where = ('the tensor-parallel group' if any(split is not None and split.group is group
                                                        for split in self._splits) else 'model_parallel_group')
            raise ValueError(f"the model's parts (ranks {ranks}, {where}) built their preconditioners differently: "
                             f'rank {ranks[other]} has '
                             f'{key}={values[other]} where rank {ranks[0]} has {key}={values[0]}. They sum KL '
                             'clipping together and precondition the layers they all hold alike: build each with the '
                             'same options')

    @staticmethod
    def _warn_of_names_in_two_parts(ranks: list[int], parts: list[tuple[list[str], set[int]]]) -> None:
        """Warns (on every rank alike) where two parts of the model that are not tensor-parallel ranks of one stage
        name a layer alike (pipeline stages each built as a new Sequential: both have a layer '0'): DCP keeps one
        entry per key, taking equal keys for replicas, so a checkpoint would hold one stage's state for both."""
        for a, (names, peers) in enumerate(parts):
            for b in range(a + 1, len(parts)):
                if ranks[b] in peers:
                    continue
                shared = sorted(set(names) & set(parts[b][0]))
                if shared:
                    warnings.warn(f"dkfac: the model's parts on ranks {ranks[a]} and {ranks[b]} both hold a K-FAC "
                                  f'layer named {shared[0]!r}: torch.distributed.checkpoint keeps one entry per name '
                                  '(it takes equal names for replicas), so a DCP checkpoint of their preconditioners '
                                  "would hold one part's state for both. Give each stage's modules the whole model's "
                                  "names (build a stage by deleting the other stages' layers from the whole model)",
                                  stacklevel=_stacklevel_outside_dkfac())
                    return

    def _owner_grid(self, core_options: dict[str, Any], group: Any) -> None:
        """Owner placement: one grad worker per layer in each row of the grid, the rows being the mesh's shard
        groups (KAISA's grad_worker_fraction = replicas / P; DP-KFAC has one owner in a world of one row)."""
        groups = [_shard_group(weight, self._splits[index]) for index, (weight, _) in enumerate(self._bound)
                  if self._sharded(index)]
        if not groups:
            return
        replicas = groups[0][1]
        if any(r != replicas for _, r in groups):
            raise ValueError('sharded_placement=owner needs every sharded layer on the same mesh')
        if core_options.get('strategy', 'kaisa') == 'kaisa':
            core_options['grad_worker_fraction'] = replicas / self._world_size

    def _place_owners(self, group: Any) -> None:
        """Checks that the core's rows of ranks are the mesh's shard groups, and gives each owner-placed layer the
        distributor of its owner and group."""
        row, owners = self._core.row_owners()
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        me = dist.get_rank()
        for index, owner in enumerate(owners):
            if not self._sharded(index) or owner < 0:
                continue
            shard_group, _ = _shard_group(self._bound[index][0], self._splits[index])
            ranks = sorted(dist.get_process_group_ranks(shard_group))
            if ranks != sorted(to_global(r) for r in row):
                raise ValueError(f'sharded_placement=owner: layer {self._names[index]!r} is sharded over ranks '
                                 f'{ranks}, but the plan places its owner in a row of ranks '
                                 f'{sorted(to_global(r) for r in row)} (strategy dp has one row of every rank: '
                                 'use kaisa on an HSDP mesh)')
            self._owners[index] = (to_global(owner), shard_group, me)
            self._distributors[index] = _distributor(*self._bound[index], was=self._distributors[index],
                                                     owner=self._owners[index], split=self._splits[index])

    def _sharded(self, index: int) -> bool:
        """Whether layer `index` is sharded by FSDP2 or HSDP (a whole layer or a tensor-parallel slice)."""
        return self._distributors[index].shard_ranks > 0

    @staticmethod
    def _make_communicator(group: Any, timeout: float | None) -> Any:
        backend = str(dist.get_backend(group))
        known = {'gloo', 'nccl'}
        if not set(part.split(':')[-1] for part in backend.split(',')) <= known:
            raise ValueError(f"process_group uses the {backend!r} backend; dkfac communicates through groups with "
                             "the gloo and nccl backends (e.g. init_process_group('nccl'), 'gloo', or "
                             "'cpu:gloo,cuda:nccl')")
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        prefix = f'dkfac/py{next(_communicators)}/{ranks[0]}-{ranks[-1]}-{len(ranks)}/'
        seconds = timeout if timeout is not None else _group_timeout(group)
        return _C.communicator(group, store, prefix, float(seconds))  # group.WORLD is the default group


    # --- hyper-parameters, as kfac_pytorch exposes them -------------------------------------------------
    @property
    def _factor_update_steps(self) -> Callable[[int], int] | int:
        return self.__dict__['_factor_update_steps_value']

    @_factor_update_steps.setter
    def _factor_update_steps(self, value: Callable[[int], int] | int) -> None:
        # The end of each step() arms the hooks by the next step's factor interval; a new one (kfac_pytorch's
        # LambdaParamScheduler.step() after step()) arms them again, before the forward pass they decide.
        self.__dict__['_factor_update_steps_value'] = value
        core = self.__dict__.get('_core')
        if core is not None and not self.__dict__.get('_forward_seen', [False])[0]:
            core.rearm_capture()

    def _value(self, name: str) -> Any:
        value = getattr(self, '_' + name)
        return value(self.steps) if callable(value) else value

    def _set(self, name: str, value: Any) -> None:
        value = _hyper_value(name, value)
        if name == 'kl_clip' and value is None:
            value = 0.0  # None or 0 turns KL clipping off
        _C.option_values({name: value})  # checked as at construction, naming the option
        setattr(self, '_' + name, value)

    @staticmethod
    def _hyper(name: str, doc: str) -> property:
        # kfac_pytorch's are read-only (its schedulers assign the private attribute); here an assignment sets a
        # number or a callable of the step from the next step() on (factor_update_steps: from the next forward).
        return property(lambda self: self._value(name), lambda self, value: self._set(name, value), doc=doc)

    damping = _hyper('damping', 'Damping at the current step.')
    factor_decay = _hyper('factor_decay', 'Factor decay at the current step.')
    kl_clip = _hyper('kl_clip', 'KL-clip bound at the current step (0: off).')
    lr = _hyper('lr', 'Learning rate KL clipping uses at the current step.')
    factor_update_steps = _hyper('factor_update_steps', 'Steps between factor updates, at the current step.')
    inv_update_steps = _hyper('inv_update_steps', 'Steps between second-order updates, at the current step.')

    @property
    def steps(self) -> int:
        """K-FAC steps taken (calls to step())."""
        return self._core.steps

    @property
    def layers(self) -> list[tuple[str, torch.nn.Module]]:
        """The preconditioned layers as (name, module), in model order."""
        return list(zip(self._names, self._modules))

    @property
    def strategy_choice(self) -> str:
        """strategy='auto''s choice in words: every candidate's predicted K-FAC time and memory per rank, the
        pick and why ('' before the first step() chose, and without 'auto'). Logged at ``loglevel`` too."""
        return self._core.strategy_choice

    @property
    def plan(self) -> str:
        """The step plan this job runs, in words (a str): how factors are reduced, who decomposes and
        preconditions each layer, what is broadcast (the C++ core's StepPlan; every rank computes the same
        one), and for SPD-KFAC what was measured and the fusion grouping in use."""
        return self._core.describe()

    # --- the step ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """Preconditions the registered layers' gradients in place (one K-FAC step).

        Updates factors on factor steps and the second-order state on inverse steps, then preconditions,
        KL-clips and writes the gradients. Call after backward (after all accumulation micro-batches), with
        gradients already averaged across ranks, and before the optimizer's step().
        """
        if self._retired:
            raise RuntimeError(self._retired)
        if self._supersedes:
            self._take_over()
        self._follow_parameters()
        if getattr(self, '_frozen_aside', None):
            self._warn_of_unfrozen_layers()
        # The distributors' gather and scatter run inside the core's step, which times and counts them.
        moves = ((lambda: self._move('gather')), (lambda: self._move('scatter'))) if self._moves_gradients() else ()
        if moves:
            self._refuse_repeated_step()
        self._stepped = None
        try:
            with torch.no_grad(), _CoreWarnings():
                self._core.step(*moves, sum_over_model=self._sum_over_model if self._model_group is not None else None,
                                counted_elsewhere=self._counted_elsewhere)
        except RuntimeError as error:
            replaced = self._replaced_modules()
            if replaced and 'K-FAC layer' in str(error):  # a refusal of a layer, not a lost rank or out of memory
                raise ValueError(f'{replaced}: the preconditioner hooked the module that was there when it was built; '
                                 'build it (and the optimizer) after replacing modules') from error
            if self._global_ranks and 'lost rank' in str(error) and self._global_ranks not in str(error):
                raise RuntimeError(f'{error}{self._global_ranks}') from error
            raise
        self._forward_seen[0] = False
        self._stepped = [(weakref.ref(weight.grad), weight.grad._version) if weight.grad is not None else None
                         for weight, _ in self._bound]
        change = self._core.take_plan_change()  # strategy='auto''s choice at the first step, SPD-KFAC's grouping
        if change:
            logger.log(self._loglevel, 'dkfac: %s', change.rstrip())

    _stepped: list[tuple[weakref.ref, int] | None] | None = None  # each weight's gradient and version after step()

    def _refuse_repeated_step(self) -> None:
        """Where the core preconditions stand-ins of DTensor gradients (gathered for it under FSDP2 and HSDP, a new
        tensor at every step; or a tensor-parallel slice's local tensor, whose version follows the DTensor's
        writes only as _TensorParallelSlice._local_part moves it), it cannot tell a second step() on the same
        gradients: refused here, as the core refuses it for the gradients it preconditions in place, where no
        layer's gradient was written (a backward pass, zero_grad) since the last step()."""
        if self._stepped is None or all(stepped is None for stepped in self._stepped):
            return
        for (weight, _), stepped in zip(self._bound, self._stepped):
            if weight.grad is None and stepped is None:
                continue
            if stepped is None or stepped[0]() is not weight.grad or stepped[1] != weight.grad._version:
                return
        raise RuntimeError(f'step() called again on the gradients the last step() (step {self.steps - 1}) '
                           'preconditioned: no backward pass wrote them since, and a second step() would precondition '
                           'them twice. Call step() once after each backward pass (after all accumulation '
                           'micro-batches)')

    def _replaced_modules(self) -> str:
        """The registered layers whose name in the model now holds another module (an untied lm_head made anew by
        resize_token_embeddings, a layer assigned by hand), in words; '' if none or the model is gone."""
        model = self._model_ref() if getattr(self, '_model_ref', None) is not None else None
        if model is None:
            return ''
        replaced = []
        for name, module in zip(self._names, self._modules):
            try:
                now = model.get_submodule(name)
            except AttributeError:
                now = None
            if now is not module:
                replaced.append(f'layer {name!r} ({type(module).__name__}) is not the model\'s {name!r} any more ('
                                + (f'a new {type(now).__name__}' if now is not None else 'gone') + ')')
        return '; '.join(replaced)

    def _sum_over_model(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` in place over the ranks holding the model's other parts (the core's KL-clip sum)."""
        with self._naming_lost_ranks("summing the KL clip over the model's parts"):
            dist.all_reduce(tensor, group=self._model_group)

    def _moves_gradients(self) -> bool:
        return any(distributor.moves for distributor in self._distributors)

    def _move(self, way: str) -> tuple[int, int]:
        """Every distributor's gather (``way='gather'``: the sharded layers' gradients into the core's full-shaped
        stand-ins, before its step reads them) or scatter (``'scatter'``: the preconditioned rows back, after it
        wrote them): their collectives started together, then waited for. Returns the collectives run and the
        bytes this rank moved, which the core counts as gradient traffic."""
        what = ("gathering the sharded layers' gradients" if way == 'gather'
                else "scattering the sharded layers' preconditioned gradients")
        with self._naming_lost_ranks(what):
            try:
                works = []
                for distributor, bound in zip(self._distributors, self._bound):
                    distributor.moved = [0, 0]
                    works += getattr(distributor, 'start_' + way)(*bound)
                for work in works:
                    work.wait()
                for distributor in self._distributors:
                    getattr(distributor, 'finish_' + way)()
            except BaseException:
                if way == 'gather':  # the step will not run: no whole gradient is kept until the next one
                    for distributor in self._distributors:
                        for stand_in in getattr(distributor, 'stand_ins', ()):
                            if stand_in is not None:
                                stand_in.grad = None
                raise
        return (sum(d.moved[0] for d in self._distributors), sum(d.moved[1] for d in self._distributors))

    @contextlib.contextmanager
    def _naming_lost_ranks(self, what: str) -> Iterator[None]:
        """Names the lost rank in the error of a collective torch runs for step() (FSDP2's gathers and scatters of
        sharded gradients), as dkfac's own collectives' errors do: the communicator's watchdog says which ranks
        went silent. Where none did, the error is the collective's own."""
        try:
            yield
        except RuntimeError as error:
            diagnosis = self._communicator.diagnose_failure() if self._communicator is not None else ''
            if not diagnosis:
                raise
            lost = f'lost {diagnosis}{self._global_ranks}'
            raise RuntimeError(f'dkfac step(): {what} failed ({lost}): {error}') from error

    def _warn_of_unfrozen_layers(self) -> None:
        """Layers set aside at construction because they were frozen, trained since (unfrozen: the usual fine-tuning
        schedule): they keep their plain gradients, which is said once, naming them and the way to precondition
        them."""
        unfrozen = [(name, module) for name, module in self._frozen_aside
                    if all(p.requires_grad for p in module.parameters()) and module.weight.grad is not None]
        if not unfrozen:
            return
        self._frozen_aside = [entry for entry in self._frozen_aside if entry not in unfrozen]
        names = ', '.join(repr(name) for name, _ in unfrozen[:4]) + (f' and {len(unfrozen) - 4} more'
                                                                       if len(unfrozen) > 4 else '')
        warnings.warn(f'dkfac: {len(unfrozen)} layer(s) frozen when the preconditioner was built now train ({names}) '
                      'and keep their plain gradients: K-FAC preconditions the layers chosen then. To precondition '
                      "them, build the preconditioner with them trainable and unused_layer_policy='skip', then "
                      'freeze them: a layer frozen after the build keeps its plain gradient while frozen and is '
                      'preconditioned once it trains', stacklevel=_stacklevel_outside_dkfac())

    def _follow_parameters(self) -> None:
        """Re-binds the core to each module's current parameters where they were replaced since the last step:
        ``load_state_dict(assign=True)`` (how meta-device initialisation and Hugging Face load weights) and
        ``layer.weight = torch.nn.Parameter(...)`` give a module new Parameter objects, and the core would
        otherwise keep preconditioning the old ones, whose gradients no longer change: K-FAC silently off."""
        for index, module in enumerate(self._modules):
            weight, bias = module.weight, getattr(module, 'bias', None)
            if _fsdp1_flattened(weight):  # wrapped after the build (before it, _register refuses the model)
                raise ValueError(_fsdp1(f'layer {self._names[index]!r} ({type(module).__name__}) was'))
            bound_weight, bound_bias = self._bound[index]
            if weight is bound_weight and bias is bound_bias:
                if tuple(weight.shape) != self._shapes[index]:
                    raise ValueError(_resized(self._names[index], module, self._shapes[index]))
                follow = getattr(self._distributors[index], 'follow_requires_grad', None)
                if follow is not None:
                    follow(weight, bias)
                continue
            # fully_shard after the preconditioner was built turns a layer's Parameters into DTensors: the core
            # then preconditions full-shaped stand-ins (same shape, dtype and device), as for a model sharded first.
            sharded = _is_sharded(weight, bias)
            if self._splits[index] is not None:  # new local tensors: new stand-ins, the split as it was
                split = self._splits[index]
                now = _tensor_parallel(self._names[index], module, 'exact' if split.exact else 'block_diagonal')
                if now is None or (now.style, now.gathered, now.shard_ranks) != (split.style, split.gathered,
                                                                                  split.shard_ranks):
                    raise ValueError(f'layer {self._names[index]!r}: its tensor-parallel parameters were replaced by '
                                     'ones placed otherwise (fully_shard after the preconditioner was built?); its '
                                     'plan keeps the layer as it was then: split and shard the model first, then build '
                                     'the preconditioner')
                self._distributors[index] = _distributor(weight, bias, split=split, owner=self._owners[index])
            elif sharded != self._sharded(index):
                if self._owner_placed:
                    raise ValueError(f'sharded_placement=owner: layer {self._names[index]!r} was '
                                     f'{"sharded" if sharded else "unsharded"} after the preconditioner was '
                                     'built; its plan places the layer as it was then: shard the model (fully_shard) '
                                     'first, then build the preconditioner')
                self._distributors[index] = _distributor(weight, bias)
            # else the same distributor: a sharded layer's stand-ins stay, and nothing changes for the core
            with _CoreWarnings():
                self._core.rebind_layer(index, *self._distributors[index].core_tensors(weight, bias))
            self._bound[index] = (weight, bias)
            self._watch_weight(index)

    def _take_over(self) -> None:
        """At this preconditioner's first step(), retires each one still hooked to a layer of it when it was built:
        its hooks go, and its step() raises from now on. A framework builds the new optimizer before it drops the
        old one (Lightning's lr_find or scale_batch_size and then fit, a second fit), so refusing the new one at its
        build stopped them."""
        superseded, self._supersedes = self._supersedes, []
        for ref, layer in superseded:
            other = ref()
            if other is None or other._retired:
                continue
            other._retired = (f'this {type(other).__name__} was superseded by another built on its model (layer '
                              f'{layer}), which now hooks its layers: step() that one (or the optimizer built '
                              'with it)')
            other._release_hooks()
            if other._communicator is not None:
                other._communicator.stop_watchdog()
            warnings.warn(f'dkfac: layer {layer} was registered with another {type(other).__name__}, still alive '
                          '(held by a framework: the optimizer of an earlier fit or of a tuner, say): this one, '
                          "stepped now, takes its layers over, and the other's step() raises",
                          stacklevel=_stacklevel_outside_dkfac())

    def _watch_weight(self, index: int) -> None:
        """A sharded layer's core sees stand-ins, which the optimizer never writes: its capture watches the shard the
        optimizer writes in place, so that a step after the optimizer's is refused (the core watches the weight
        itself elsewhere)."""
        if isinstance(self._distributors[index], _StandIns):
            weight = self._bound[index][0]
            self._captures[index].watch_weight(weight._local_tensor)
        # max_norm renormalizes the looked-up rows in place at every forward (an evaluation after the backward pass,
        # an activation checkpoint's recomputation): only the optimizer hook says such a weight was written.
        module = self._modules[index]
        if isinstance(module, torch.nn.Embedding) and module.max_norm is not None:
            self._captures[index].set_weight_written_in_forward(True)

    def reset_batch(self) -> None:
        """Drops what the hooks captured since the last factor update (with ``fold_in_hooks``, what they folded into
        the factors stays there, which it says once)."""
        with _CoreWarnings():
            self._core.reset_batch()

    def cuda_graph_report(self) -> dict[str, Any]:
        """With ``cuda_graphs``: ``captures`` (CUDA graphs captured), ``replays`` (steps whose preconditioning,
        guard and gradient writes were a graph's replay), ``eager_steps`` (preconditioning steps without one),
        ``off`` (why none is captured for good: no CUDA device, a capture that failed; '' while they may be) and
        ``last_eager`` (why the last step without one had none: a factor or second-order update, eigen_adam's
        moments made or rotated into a new eigenbasis, a gradient broadcast, gradients or state moved since the step
        before)."""
        return self._core.cuda_graph_report()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state held on this rank, by kind, and their total (``adam_moments``: eigen_adam's m, v
        and step counts, once held; ``second_order_in_flight``: with ``second_order_lag``, while an update is
        computed beside the steps, a second copy of the sides of layers this rank computes, the factors it reads
        where newer ones replaced them, and the old stacks of ``stack_layers`` where the groups were planned again
        meanwhile; ``stack_padding``: with ``pad_widths`` > 1, the pads of the stacks of layers of one shape)."""
        sizes = dict.fromkeys(('a_factors', 'g_factors', 'a_batch', 'g_batch', 'a_inverses', 'g_inverses'), 0)
        kinds = {key: 'adam_moments' if moment else f"{side}_{'factors' if factor else 'inverses'}"
                 for key, factor, side, moment in _STATE_ENTRIES}
        for state in self._core.layer_states():
            for key, tensor in state.items():  # 'adam_moments' appears once eigen_adam holds them
                sizes[kinds[key]] = sizes.get(kinds[key], 0) + tensor.numel() * tensor.element_size()
        for capture in self._captures:
            a, g = capture.pending_bytes()
            sizes['a_batch'] += a
            sizes['g_batch'] += g
        in_flight = self._core.second_order_in_flight_bytes()
        if in_flight:  # as 'adam_moments': only where held, so that kfac_pytorch's keys stay the rest
            sizes['second_order_in_flight'] = in_flight
        padding = self._core.stack_padding_bytes()
        if padding:
            sizes['stack_padding'] = padding
        sizes['total'] = sum(sizes.values())
        return sizes

    def phase_times(self, total: bool = False) -> dict[str, float]:
        """Seconds per K-FAC phase: of the last step() (``total=False``) or summed over every step() so far
        (``total=True``). Wall-clock time on a CPU; on a GPU, the device's time between CUDA events around each
        phase (reading them waits for the step's work to finish)."""
        return self._core.total_times() if total else self._core.last_step_times()

    # --- state ---------------------------------------------------------------------------------------------
    def state_dict(self, include_factors: bool = True, gathered: bool = False,
                   include_second_order: bool = True) -> dict[str, Any]:
        """The state an exact resume needs, in kfac_pytorch's layout plus dkfac's second-order state.

        ``steps``; each hyper-parameter that is not a callable; with ``include_factors``, ``layers``
        ({name: {'A': A, 'G': G}}, what kfac_pytorch reads) and ``dkfac`` (format version, compute method,
        strategy, world size, each layer's second-order state, and ``held``: for each entry listed, whether it
        was computed yet).

        What it holds in a distributed job:

        - ``gathered=False`` (kfac_pytorch's behaviour, callable on one rank alone): what this rank's plan keeps
          whole (the core's ``state_template``): the factors of the layers it builds factors for (every layer
          under KAISA and SPD-KFAC, its own layers under DP-KFAC) and the second-order state of the layers it
          preconditions. Ranks that hold an entry hold the same value, and no rank holds another's. So it is
          also the preconditioner's ``Stateful`` state for ``torch.distributed.checkpoint``: ``dcp.save({'kfac':
          preconditioner})`` has each entry written once without gathering, and ``dcp.load`` on any world size
          reads each rank's own entries of its new plan (docs/STRATEGIES.md, "Checkpoints").
        - ``gathered=True`` (collective: every rank calls it, e.g. before rank 0 saves): every layer's factors
          and second-order state, the same on every rank, whatever the strategy. It loads exactly on any world
          size and strategy: each rank keeps the part its plan gives it. Under tensor parallelism it holds the
          slices of this rank's tensor-parallel position only (gathered over ``process_group``): save one per
          position, or checkpoint through torch.distributed.checkpoint, which writes every position's.

        ``include_second_order=False`` leaves the second-order state out (the eigen method's eigenvectors,
        eigenvalues and denominators are twice the factors' size and more): ``load_state_dict`` then recomputes it
        from the factors. The resume is exact where the factors have not changed since the last inverse step
        (saved right after an inverse step, the last ``step()`` one); saved later, the resumed job preconditions with
        the current factors' decomposition until its next inverse step, where the uninterrupted one uses the older
        one, and the two drift apart from there. With ``eigen_adam``, Adam's moments (``exp_avg``, ``exp_avg_sq``,
        ``adam_steps``) are kept either way: they are expressed in the eigenbasis of the last inverse step, which the
        recomputation gives back where the factors have not changed since.

        Its tensors are copies of the live state, on its device (at most ``memory_usage()['total']`` bytes more
        while the dict lives): ``dcp.load`` fills them in place, and nothing the preconditioner uses changes until
        ``load_state_dict()`` has checked all of it. A refused or failed load leaves the live state as it was.
        """
        state: dict[str, Any] = {'steps': self.steps}
        for name in _SCHEDULED:
            value = getattr(self, '_' + name)
            if not callable(value):
                state[name] = value
        if not include_factors:
            return state
        folded = self._core.layers_folded_since_step()
        if folded:
            warnings.warn(f'dkfac: state_dict(): the factors of {folded} layer(s) already hold this step\'s batch, '
                          'folded in their backward hooks (fold_in_hooks=True), though step() has not run and '
                          "'steps' does not count it: a resume that repeats this step counts that batch twice. Save "
                          'after step(), or build the preconditioner with fold_in_hooks=False', stacklevel=2)
        with _CoreWarnings():
            if gathered:
                layer_states = self._core.gathered_layer_states()
                wanted = [{key: None for key in held} for held in layer_states]
            else:
                layer_states = self._core.layer_states()
                wanted = self._core.state_template()
        layers, second_order, held = {}, {}, {}
        for name, have, want in zip(self._state_names, layer_states, wanted):
            # An entry the plan places here but not computed yet (before the first step) is written as its
            # blank, so that a reader filling tensors in place finds every entry it asks for; `held` says so.
            # Copies, never the live state: torch.distributed.checkpoint.load writes a checkpoint into these
            # tensors before load_state_dict() checks it, and a refused or failed load must change nothing.
            entries = {key: have[key].detach().clone() if key in have else blank.zero_() for key, blank in want.items()
                       if include_second_order or key in _FACTOR_KEYS or key in _MOMENT_KEYS}
            held[name] = {key: key in have for key in entries}
            layers[name] = {side: entries[key] for key, side in _FACTOR_KEYS.items() if key in entries}
            second_order[name] = {key: t for key, t in entries.items() if key not in _FACTOR_KEYS}
        state['layers'] = layers
        state['dkfac'] = {
            'format_version': _STATE_FORMAT,
            'compute_method': self._core.compute_method,
            'strategy': self._core.strategy,
            'gathered': bool(gathered),
            'world_size': self._world_size,
            'second_order': second_order,
            'held': held,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restores a state dict from dkfac's or kfac_pytorch's state_dict(), or filled in by
        ``torch.distributed.checkpoint.load``.

        The second-order state is restored exactly where every rank finds, with the same compute method, the
        whole second-order state of each layer it preconditions (this rank's own dict, a gathered one, or a
        DCP checkpoint of any world size). Otherwise, e.g. kfac_pytorch's, the factors are loaded and, with
        ``compute_inverses``, the second-order state is recomputed from them now (collective: every rank
        calls it). Each rank's own dict of one save, each loaded on its own rank, resumes under another plan (a
        part a rank keeps but was not handed comes from the rank that was); a dict that lacks factors this rank's
        plan builds and no rank was handed (another rank's DP-KFAC state alone) is refused, on every rank alike.
        In a job of several ranks every rank calls it (it is collective): a dict one rank's checks refuse is refused
        on every rank at once, the others naming that rank and its reason, and nothing is loaded. Layers pair by
        name, or, for a dict saved from the model under other torch wrappers
        (``module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``), by name without their parts.
        """
        try:
            checked, refusal = self._checked_state(state_dict, compute_inverses), None
        except Exception as error:  # any refusal: agreed below, then raised as it was
            checked, refusal = None, error
        if self._communicator is not None:
            # The restore below is collective: a dict refused on one rank stops every rank now, named, where the
            # others would wait for it there until it was named lost.
            said = '' if refusal is None else f'{type(refusal).__name__}: {refusal}'
            first = self._communicator.first_refusal(said)
            if first and refusal is None:
                raise ValueError(f'state_dict: the state dict given to {first.split(":")[0]} was refused there, so '
                                 f'nothing was loaded on any rank (load_state_dict is collective): {first}')
        if refusal is not None:
            raise refusal
        steps, states, method, per_rank_writer, unheld, hyper = checked
        with _CoreWarnings():
            if 'layers' in state_dict:
                self._core.restore(steps, states, method, per_rank_writer, compute_inverses, unheld)
            else:  # no layer state to restore: the step count only, each layer keeping its own
                self._core.load_layer_states(steps, self._core.layer_states())
        changed = [f'{name} {_shown(getattr(self, "_" + name))} -> {value}' for name, value in hyper.items()
                   if callable(getattr(self, '_' + name)) or getattr(self, '_' + name) != value]
        if changed:  # kfac_pytorch's load_state_dict takes them too, without a word
            warnings.warn('dkfac: state_dict: its hyper-parameters replace this preconditioner\'s: ' +
                          ', '.join(changed) + '. To keep this run\'s, assign them after the load '
                          '(preconditioner.damping = ...)',
                          stacklevel=2)
        for name, value in hyper.items():
            setattr(self, '_' + name, value)

    def _checked_state(self, state_dict: dict[str, Any], compute_inverses: bool) -> tuple[Any, ...]:
        """load_state_dict's checks of this rank's dict, which change nothing: (steps, the layers' states, the
        compute method, the per-rank writer's message, the entries not held, the hyper-parameters), or raises
        naming what is wrong."""
        states, method, per_rank_writer, unheld = [], None, '', []
        if 'steps' not in state_dict:
            raise KeyError("state_dict has no 'steps' entry; is it a K-FAC preconditioner's state_dict()?")
        steps = int(state_dict['steps'])
        ours = state_dict.get('dkfac')
        if isinstance(ours, dict) and ours.get('format_version', _STATE_FORMAT) != _STATE_FORMAT:
            raise ValueError(f"dkfac state format {ours.get('format_version')} is not {_STATE_FORMAT}, the one this "
                             'version writes and reads')
        ours = ours if isinstance(ours, dict) else {}
        held_flags = ours.get('held', {})
        if 'layers' in state_dict:
            layers = state_dict['layers']
            saved_as = self._saved_names(layers)
            states, unheld = [], []
            for index, name in enumerate(self._state_names):
                key = saved_as.get(name, name)  # its name in the state dict
                entry = layers.get(key)
                if entry is None:
                    raise ValueError(f'state_dict holds no entry for K-FAC layer {name!r} (it holds '
                                     f'{len(layers)} layers, this model registers {len(self._names)})'
                                     f'{_kind_not_saved(self._modules[index])}')
                flags = held_flags.get(key, {})
                found = {k: entry[side] for k, side in _FACTOR_KEYS.items() if side in entry}
                found.update(ours.get('second_order', {}).get(key, {}))
                # Present: written and computed (kfac_pytorch writes None for a factor not built yet); a blank the
                # writer did not hold (a layer that never built its factors) is neither loaded nor missing.
                states.append({k: t for k, t in found.items() if t is not None})
                unheld.append({k for k in found if not flags.get(k, True)})
            method = ours.get('compute_method')  # None: kfac_pytorch's, whose inverses are recomputed
            writer = (f"rank {ours['rank']}'s own state of a {ours.get('world_size')}-rank job" if 'rank' in ours
                      else "another rank's own state")
            # The core's one restore decides (Preconditioner::restore): parts a rank lacks taken from the ranks
            # handed them, refused where this rank's factors are missing still after the first step (another
            # rank's DP-KFAC share alone), exact where every rank finds this
            # method's whole second-order state, recomputed from the factors otherwise.
            per_rank_writer = (f"it is {writer}, which holds the factors of that rank's own layers only (DP-KFAC); "
                               f'to resume on rank {self._rank} of {self._world_size}, save '
                               'state_dict(gathered=True), called on every rank, or checkpoint through '
                               'torch.distributed.checkpoint')
        elif compute_inverses:
            warnings.warn('state_dict holds no layer factors, so the second-order state cannot be computed; '
                          'skipping it', stacklevel=3)
        # Checked first, applied only once the core took the layers: a refused state dict changes nothing.
        hyper = {name: state_dict[name] for name in _SCHEDULED if name in state_dict}
        if hyper.get('kl_clip', 0.0) is None:
            hyper['kl_clip'] = 0.0  # as the constructor: None turns KL clipping off
        if getattr(self, 'eigen_adam', False) and hyper.get('kl_clip'):
            warnings.warn(f"state_dict: its kl_clip={hyper['kl_clip']} is not loaded: this preconditioner runs "
                          'eigen_adam, whose step KL clipping does not apply to (kl_clip stays 0)', stacklevel=3)
            del hyper['kl_clip']
        try:
            hyper = {name: _hyper_value(name, value) for name, value in hyper.items()}
            _C.option_values(hyper)  # the constructor's checks (dkfac/options.h), naming the option
        except (TypeError, RuntimeError, ValueError) as error:
            raise ValueError(f'state_dict: {error}') from None
        return steps, states, method, per_rank_writer, unheld, hyper

    def _saved_names(self, saved: Any) -> dict[str, str]:
        """{this preconditioner's name of a layer: its key in a state dict's ``layers``}: the same name, or, where
        the state dict was saved from the model under other torch wrappers (DistributedDataParallel's ``module.``,
        torch.compile's ``_orig_mod.``, checkpoint_wrapper's ``_checkpoint_wrapped_module.``; kfac_pytorch saves
        the names as dkfac does), the one that is the same without them, where that pairs the names one to one.
        Refused naming the names it holds that this model does not register otherwise."""
        saved = list(saved)
        ours = set(self._state_names)
        if set(saved) <= ours:
            return {name: name for name in saved}
        ours_bare = {_wrapper_free(name): name for name in self._state_names}
        saved_bare = {_wrapper_free(name): name for name in saved}
        if len(ours_bare) == len(ours) and len(saved_bare) == len(saved) and set(saved_bare) <= set(ours_bare):
            return {ours_bare[bare]: name for bare, name in saved_bare.items()}
        unknown = sorted(set(saved) - ours)
        raise ValueError(f'state_dict holds K-FAC layers this model does not register: {unknown} (names are also '
                         "matched without torch's wrappers: DistributedDataParallel's module., torch.compile's "
                         f'_orig_mod.; this model registers {self._state_names[:4]}'
                         f'{" ..." if len(self._state_names) > 4 else ""})')

    def __repr__(self) -> str:
        """kfac_pytorch's fields (and the subclass's ``defaults``), one per line, sorted by name."""
        params = {
            'accumulation_steps': self._accumulation_steps, 'assignment': self._core.system,
            'damping': self._damping, 'factor_decay': self._factor_decay,
            'factor_update_steps': self._factor_update_steps, 'inv_update_steps': self._inv_update_steps,
            'kl_clip': self._kl_clip, 'layers': len(self._layers), 'loglevel': self._loglevel, 'lr': self._lr,
            'steps': self.steps, 'update_factors_in_hook': self._update_factors_in_hook,
        }
        params.update(self._defaults or {})
        body = '\n'.join(f'  {k}={v},' for k, v in sorted(params.items()))
        return f'{type(self).__name__}(\n{body}\n)'
