"""dkfac.optim: K-FAC as a ``torch.optim.Optimizer``, for training loops and frameworks that take one optimizer.

``KFAC`` wraps a base optimizer (AdamW, SGD, ...) and a K-FAC preconditioner; its ``step()`` preconditions the
gradients, then runs the base optimizer's step::

    opt = dkfac.optim.KFAC(model, torch.optim.AdamW(model.parameters(), lr=3e-4), factor_update_steps=10)
    loss.backward()
    opt.step()          # preconditioner.step(), then AdamW's step()
    opt.zero_grad()

Everything an optimizer is asked for by LR schedulers, ``torch.amp.GradScaler``, gradient clipping, Hugging
Face's ``Trainer`` (through accelerate's ``AcceleratedOptimizer``) and PyTorch Lightning is the base
optimizer's: ``param_groups`` (the same list object), ``state`` and ``defaults``. ``state_dict()`` holds both
halves.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch

from dkfac import _C
from dkfac.base_preconditioner import _is_dtensor
from dkfac.base_preconditioner import _local
from dkfac.base_preconditioner import BaseKFACPreconditioner
from dkfac.preconditioner import KFACPreconditioner

__all__ = ['KFAC']

_KFAC_KEY = 'kfac'  # the entry of the first parameter group that holds the preconditioner's state


def _indent(text: str, prefix: str = '  ') -> str:
    return '\n'.join(prefix + line for line in text.splitlines())


def _layer_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters the preconditioner rewrites the gradients of: the layer's weight and bias."""
    return [p for p in (getattr(module, 'weight', None), getattr(module, 'bias', None)) if p is not None]


class _LrOf:
    """The preconditioner's ``lr`` schedule when it follows the base optimizer: the lr of its first param group
    at the time the preconditioner reads it (each ``step()``), whatever the K-FAC step. A named class (not a
    lambda) so that ``repr(preconditioner)`` says what it is."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def __call__(self, step: int) -> float:
        return float(self._optimizer.param_groups[0]['lr'])

    def __repr__(self) -> str:
        return f"<param_groups[0]['lr'] of {type(self._optimizer).__name__}>"


class _EveryStepCost:
    """Warns once when factor and inverse updates at every step make a training step more than twice as dear as it
    is without K-FAC (kfac_pytorch's defaults, which the README's Trainer snippet used to keep without a word; issue
    45 measured 2.6x an AdamW step with them on a small GPT-2). Measured at the optimizer's CHECK_AT-th step: the
    wall time since the previous step() (one training iteration) against the preconditioner's time in it
    (phase_times(); on a GPU, reading it waits for that step's work, once)."""

    CHECK_AT = 5

    def __init__(self) -> None:
        self.steps = 0
        self.last: float | None = None

    def check(self, preconditioner: BaseKFACPreconditioner) -> None:
        now, last = time.perf_counter(), self.last
        self.last = now
        self.steps += 1
        if self.steps != self.CHECK_AT or last is None:
            return
        if preconditioner.factor_update_steps != 1 or preconditioner.inv_update_steps != 1:
            return
        kfac = sum(preconditioner.phase_times().values())
        iteration = now - last
        if iteration - kfac <= 0 or iteration / (iteration - kfac) <= 2.0:
            return
        warnings.warn(f'dkfac.optim.KFAC: factor and inverse updates at every step make a training step '
                      f'{iteration / (iteration - kfac):.1f}x as dear as without K-FAC ({1000 * kfac:.1f} ms of '
                      f'{1000 * iteration:.1f} ms at step {self.steps}); fewer updates cost a fraction of that, e.g. '
                      'factor_update_steps=10, inv_update_steps=100 (docs/PERFORMANCE.md)', UserWarning, stacklevel=4)


def _check_eigen_adam_base(optimizer: torch.optim.Optimizer) -> None:
    """eigen_adam applies AdamW's update with K-FAC's basis: the base must be AdamW (or Adam without its L2
    weight decay, which would have to enter the gradient before the moments), with nothing it would do otherwise."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f'eigen_adam runs Adam in the K-FAC eigenbasis and AdamW on the other parameters: the base '
                        f'optimizer must be torch.optim.AdamW (or Adam), got {type(optimizer).__name__}')
    for i, group in enumerate(optimizer.param_groups):
        if not isinstance(optimizer, torch.optim.AdamW) and group.get('weight_decay', 0.0):
            raise ValueError(f"eigen_adam with torch.optim.Adam: param group {i} has weight_decay="
                             f"{group['weight_decay']}, Adam's L2 penalty (added to the gradient); eigen_adam decays "
                             'weights as AdamW does: use torch.optim.AdamW')
        for flag in ('amsgrad', 'maximize'):
            if group.get(flag):
                raise ValueError(f'eigen_adam: param group {i} has {flag}=True, which Adam in the eigenbasis does '
                                 'not do; turn it off')


def _eigen_adam_keywords(optimizer: torch.optim.Optimizer, keywords: dict[str, Any]) -> dict[str, Any]:
    """The preconditioner's keywords for eigen_adam: the base's betas and eps unless given, and no KL clipping
    unless asked for (the core refuses it: KL clipping bounds a natural-gradient step, not Adam's)."""
    _check_eigen_adam_base(optimizer)
    keywords = dict(keywords)
    betas = optimizer.defaults.get('betas', (0.9, 0.999))
    keywords.setdefault('adam_beta1', float(betas[0]))
    keywords.setdefault('adam_beta2', float(betas[1]))
    keywords.setdefault('adam_eps', float(optimizer.defaults.get('eps', 1e-8)))
    keywords.setdefault('kl_clip', None)
    return keywords


class KFAC(torch.optim.Optimizer):
    """A base optimizer whose ``step()`` first preconditions the gradients with K-FAC.

    ``KFAC(model, base_optimizer, **preconditioner_keywords)`` builds a ``dkfac.KFACPreconditioner(model,
    **preconditioner_keywords)``; ``KFAC(preconditioner, base_optimizer)`` uses an existing one (a
    ``dkfac.KFACPreconditioner`` or any ``BaseKFACPreconditioner``; no further keywords then).

    - ``step(closure=None)``: runs ``closure`` first when given (under ``torch.enable_grad()``: the forward and
      backward that produce the gradients, as PyTorch Lightning passes it), then ``preconditioner.step()``, then
      the base optimizer's ``step()`` (without the closure: its gradients are the preconditioned ones, so an
      optimizer that re-evaluates its closure, ``torch.optim.LBFGS``, is refused). Returns the closure's loss
      (None without a closure). Step pre- and post-hooks registered on this optimizer run around all of it.
    - ``graft=True``: each preconditioned layer moves along K-FAC's direction by the length of the base
      optimizer's own step on its plain gradient (the base's lr, moments and weight decay carry over unchanged, as
      in Distributed Shampoo's grafting); the other parameters take the base's step. Under FSDP2 or HSDP the
      norms are the whole layer's (its shards' sums added over their ranks). Not with layers split by tensor
      parallelism.
    - ``eigen_adam=True`` (a preconditioner keyword, Options::eigen_adam): Adam in the K-FAC eigenbasis. The
      base must be ``torch.optim.AdamW`` (or ``Adam`` without weight decay): its ``betas`` and ``eps`` become the
      preconditioner's ``adam_beta1``, ``adam_beta2`` and ``adam_eps`` unless given, read at every step (a
      scheduler that cycles the momentum is followed; the groups holding preconditioned layers must then agree
      on them), and ``kl_clip`` defaults to None. Each preconditioned layer's parameter p of a group with ``lr``
      and ``weight_decay`` becomes ``p (1 - lr weight_decay) - lr d``, d the core's step in the eigenbasis
      (docs/MATH.md section 8): AdamW's update with K-FAC's basis. The other parameters take the base's own step,
      so AdamW's tuned lr, its decay/no-decay groups and its LR schedule carry over. A layer the core leaves its
      plain gradient that step (its guard, ``unused_layer_policy='skip'``) moves by ``lr`` times that gradient.
      Not with ``graft``.
    - ``param_groups``, ``state`` and ``defaults`` are the base optimizer's own objects, so LR schedulers,
      ``GradScaler.unscale_``, ``clip_grad_norm_`` over them and ``add_param_group`` act on the base.
    - ``zero_grad(set_to_none=True)`` is the base's.
    - ``state_dict()`` is ``{'base': base.state_dict(), 'kfac': preconditioner.state_dict()}``, this rank's own
      K-FAC state; with ``gathered_state_dict=True`` every layer's whole K-FAC state, gathered (collective: for
      frameworks whose every rank calls ``state_dict()`` and whose rank 0 saves it for all, as Lightning's and
      accelerate's checkpoints under DDP do, so that a DP-KFAC job resumes from that one file);
      ``load_state_dict`` checks both halves before changing either and refuses, naming what is missing or
      different, a dict of another layout (a plain optimizer's, a preconditioner's).
    - ``optimizer`` is the base optimizer (the attribute name accelerate and Lightning use for the wrapped
      optimizer), ``preconditioner`` the preconditioner.

    ``kfac_lr_follows``: whether the preconditioner's ``lr`` follows the base optimizer's learning rate. K-FAC
    uses ``lr`` only in KL clipping (``nu = min(1, sqrt(kl_clip / (lr^2 * sum(V * grad))))``, docs/MATH.md
    section 3), where it should be the learning rate the step applies. When it follows, the preconditioner's
    ``lr`` is replaced by a callable that returns ``float(param_groups[0]['lr'])`` when the preconditioner reads
    it, at each ``step()``, before the base optimizer steps: the lr this step applies, as last set by an LR
    scheduler (what kfac_pytorch's examples do with ``lr=lambda step: optimizer.param_groups[0]['lr']``). Only
    the first param group's lr is read. A callable ``lr`` is not saved in the preconditioner's state dict, and
    ``load_state_dict`` puts the follower back if a loaded state dict held a constant ``lr``. ``None`` (the
    default) follows when this constructor builds the preconditioner and no ``lr`` keyword is given, and keeps
    the preconditioner's own ``lr`` otherwise (an existing preconditioner, or an explicit ``lr=``); ``True`` with
    an existing preconditioner replaces its ``lr``; ``True`` together with ``lr=`` is a TypeError.

    With ``torch.amp.GradScaler``, pass the scaler to the preconditioner (``grad_scaler=scaler``: K-FAC's G
    factors are built from the scaled output gradients during backward, and divided by the scale) and step
    through the scaler: ``scaler.step(opt)`` unscales the gradients of ``param_groups`` (unless
    ``scaler.unscale_(opt)`` already did, e.g. before clipping) and then calls ``opt.step()``, so the
    preconditioner sees true gradients. A step the scaler skips (inf/NaN gradients) skips K-FAC as well; the
    capture of that batch stays pending and joins the next batch's, whose factor update the core then refuses
    (NaN/Inf guard: factors kept, plain gradient for that step, warned once per layer). Call
    ``opt.preconditioner.reset_batch()`` after a skipped step to drop it instead.
    """

    def __init__(
        self,
        model_or_preconditioner: torch.nn.Module | BaseKFACPreconditioner,
        optimizer: torch.optim.Optimizer,
        *,
        kfac_lr_follows: bool | None = None,
        graft: bool = False,
        gathered_state_dict: bool = False,
        **preconditioner_keywords: Any,
    ) -> None:
        if isinstance(optimizer, KFAC):
            raise TypeError('optimizer is already a dkfac.optim.KFAC; wrap the base optimizer (its .optimizer) once')
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f'optimizer must be a torch.optim.Optimizer (the base optimizer: AdamW, SGD, ...), got '
                            f'{type(optimizer).__name__}')
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError('torch.optim.LBFGS re-evaluates its closure inside step(), and those gradients would not '
                            'be preconditioned; dkfac.optim.KFAC wraps optimizers that step on the gradients they are '
                            'given (SGD, Adam, AdamW, ...)')
        if not isinstance(graft, bool):
            raise TypeError(f'graft must be True or False, got {graft!r}')
        if not isinstance(gathered_state_dict, bool):
            raise TypeError(f'gathered_state_dict must be True or False, got {gathered_state_dict!r}')
        if kfac_lr_follows is not None and not isinstance(kfac_lr_follows, bool):
            raise TypeError(f'kfac_lr_follows must be True, False or None, got {kfac_lr_follows!r}')
        # eigen_adam: Adam's constants follow the base's groups unless given here (not for a built preconditioner).
        adam_follows = (isinstance(model_or_preconditioner, torch.nn.Module) and
                        not any(k in preconditioner_keywords for k in ('adam_beta1', 'adam_beta2', 'adam_eps')))
        if preconditioner_keywords.get('eigen_adam'):
            preconditioner_keywords = _eigen_adam_keywords(optimizer, preconditioner_keywords)
        if isinstance(model_or_preconditioner, BaseKFACPreconditioner):
            if preconditioner_keywords:
                raise TypeError('keyword arguments ' + ', '.join(sorted(preconditioner_keywords)) + ' configure a '
                                'preconditioner that KFAC builds from a model; this one was given a built '
                                'preconditioner (set its options where it is built)')
            preconditioner = model_or_preconditioner
            follows = bool(kfac_lr_follows)
        elif isinstance(model_or_preconditioner, torch.nn.Module):
            if kfac_lr_follows and 'lr' in preconditioner_keywords:
                raise TypeError("kfac_lr_follows=True sets the preconditioner's lr; give lr= or kfac_lr_follows=True, "
                                'not both')
            follows = kfac_lr_follows if kfac_lr_follows is not None else 'lr' not in preconditioner_keywords
            preconditioner = KFACPreconditioner(model_or_preconditioner, **preconditioner_keywords)
        else:
            raise TypeError('model_or_preconditioner must be a torch.nn.Module or a dkfac KFACPreconditioner, got '
                            f'{type(model_or_preconditioner).__name__}')

        # torch.optim.Optimizer.__init__ is not called: it would copy the parameters into param groups of this
        # object. param_groups, state and defaults are the base optimizer's (properties below); what the base
        # class's methods (step hooks, state-dict hooks, the profiler's step wrapper) need is set here.
        self._base = optimizer
        self._preconditioner = preconditioner
        self._kfac_lr_follows = follows
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._cost = _EveryStepCost()
        self._graft = graft
        self._gathered_state_dict = gathered_state_dict
        self._scaler_checks_left = 3  # _check_loss_scale's
        self._eigen_adam = bool(getattr(preconditioner, 'eigen_adam', False))
        self._adam_follows = self._eigen_adam and adam_follows
        self._adam_constants: tuple[float, float, float] | None = None
        if self._eigen_adam:
            _check_eigen_adam_base(optimizer)
            self._follow_adam_constants()
            if graft:
                raise ValueError('dkfac.optim.KFAC: graft=True takes the length of the base optimizer\'s step; '
                                 "eigen_adam's step is Adam's own, with its own length: use one of them")
        split = [name for (name, _), s in zip(preconditioner.layers, getattr(preconditioner, '_splits', ()))
                 if s is not None]
        if graft and split:
            raise ValueError(f'dkfac.optim.KFAC: graft=True with layers split by tensor parallelism ({split[0]!r}'
                             f'{f" and {len(split) - 1} more" if len(split) > 1 else ""}) is not supported yet (a '
                             'model sharded by FSDP2 or HSDP alone is); use graft=False')
        self._patch_step_function()  # step() runs the step pre/post hooks, as every torch optimizer's
        self._check_layers_are_optimized()
        self._follow_lr()

    # --- what frameworks read: the base optimizer's own objects ------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer."""
        return self._base

    @property
    def preconditioner(self) -> BaseKFACPreconditioner:
        """The K-FAC preconditioner."""
        return self._preconditioner

    @property
    def kfac_lr_follows(self) -> bool:
        """Whether the preconditioner's lr is the base optimizer's ``param_groups[0]['lr']`` (see the class)."""
        return self._kfac_lr_follows

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._base.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._base.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._base.state

    @state.setter
    def state(self, value: Any) -> None:
        self._base.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._base.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._base.defaults = value

    # --- the step ----------------------------------------------------------------------------------------------
    def _check_loss_scale(self) -> None:
        """A torch.amp.GradScaler that steps this optimizer (scaler.step(opt)) while the preconditioner was not given
        it: G was built from output gradients scaled by its scale, so it is scale^2 too large. Said once; looked for
        at the first steps only (a loop steps through its scaler from the start), so that later steps read no
        frames."""
        if self._scaler_checks_left <= 0 or getattr(self._preconditioner, 'grad_scaler', None) is not None:
            return
        self._scaler_checks_left -= 1
        frame = sys._getframe(2)
        for _ in range(6):  # the scaler's _maybe_opt_step, then this optimizer's step wrapper
            if frame is None:
                return
            if isinstance(frame.f_locals.get('self'), torch.amp.GradScaler):
                self._scaler_checks_left = 0
                warnings.warn('dkfac.optim.KFAC: a torch.amp.GradScaler steps this optimizer, but the preconditioner '
                              'was not given it: its G factors are built from the scaled output gradients, scale^2 too '
                              'large. Pass grad_scaler=scaler to dkfac.optim.KFAC (dkfac.hf.KFACTrainer passes the '
                              "Trainer's own)", stacklevel=3)
                return
            frame = frame.f_back

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Runs ``closure`` (if given) for the gradients, preconditions them, and runs the base optimizer's step.

        Returns the closure's loss, or None. The base optimizer's step is called without the closure: the
        gradients it steps on are the ones the preconditioner has just rewritten.
        """
        if closure is None and self._stepped_to_make_state():
            self._make_base_state()
            return None
        self._check_loss_scale()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is None and not any(p.grad is not None and bool(p.grad.any()) for _, module in
                                        self._preconditioner.layers for p in _layer_parameters(module)):
                # A closure that ran no backward pass (Lightning's, when training_step returns None to skip the
                # batch): no gradient to precondition (None, or zeroed in place), and the forward's captures are
                # dropped. The base optimizer steps on whatever gradients there are, as it would without K-FAC.
                self._preconditioner.reset_batch()
                self._base.step()
                return None
        if self._preconditioner.steps < self._preconditioner._core.start_preconditioning_step:
            # Before start_preconditioning_step the preconditioner builds its factors and leaves every gradient plain:
            # the base optimizer takes its own step on all of them (eigen_adam and graft start after).
            self._preconditioner.step()
            self._base.step()
            return loss
        if self._eigen_adam:
            self._eigen_adam_step()
            return loss
        if not self._graft:
            self._preconditioner.step()
            self._cost.check(self._preconditioner)
            self._base.step()
            return loss
        self._grafted_step()
        return loss

    def _stepped_to_make_state(self) -> bool:
        """Whether this step is torch.distributed.checkpoint.state_dict's ``_init_optim_state``: an optimizer
        without state (a fresh one, or SGD without momentum) is stepped on zero gradients at lr 0 so that
        ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` find the base's state entries. That is no
        training step: K-FAC must neither count it nor precondition (no forward pass ran). Looked for only where
        every group's lr is 0, as that function sets it."""
        if not all(float(group.get('lr', 0.0)) == 0.0 for group in self._base.param_groups):
            return False
        initialiser = getattr(sys.modules.get('torch.distributed.checkpoint.state_dict'), '_init_optim_state', None)
        code = getattr(initialiser, '__code__', None)
        frame = sys._getframe(1)
        for _ in range(8):  # this step's wrappers (step hooks, the profiler's), then torch's function
            if frame is None or code is None:
                return False
            if frame.f_code is code:
                return True
            frame = frame.f_back
        return False

    def _make_base_state(self) -> None:
        """The base optimizer's step that makes its state entries, as torch's ``_init_optim_state`` means it. With
        eigen_adam the base keeps no state for the preconditioned layers' parameters (their moments are the
        preconditioner's, ``_eigen_adam_step``), so it is not given their gradients here either, and its state
        has the entries of a checkpoint written after training steps."""
        hidden = []
        if self._eigen_adam:
            for _, module in self._preconditioner.layers:
                for p in _layer_parameters(module):
                    if p.grad is not None:
                        hidden.append((p, p.grad))
                        p.grad = None
        try:
            self._base.step()
        finally:
            for p, g in hidden:
                p.grad = g

    def _grafted_step(self) -> None:
        """graft=True: each preconditioned layer moves along K-FAC's direction by the length of the step the base
        optimizer takes on its plain gradient (Distributed Shampoo's grafting, with K-FAC's direction): the base
        steps on the plain gradients (its moments, its lr and weight decay, as without K-FAC), then each layer's
        weight and bias, taken together, are put at p0 - (|p1 - p0| / |d|) d, where p0 and p1 are its parameters
        before and after the base's step and d its preconditioned gradient. Parameters outside the preconditioned
        layers take the base's step as it is. The gradients left are the plain ones. No host synchronisation."""
        blocks = [[p for p in _layer_parameters(module) if p.grad is not None] for _, module in
                  self._preconditioner.layers]
        plain = [[p.grad.clone() for p in block] for block in blocks]
        self._preconditioner.step()
        self._cost.check(self._preconditioner)
        with torch.no_grad():
            directions = [[p.grad.clone() for p in block] for block in blocks]
            before = [[p.detach().clone() for p in block] for block in blocks]
            for block, gradients in zip(blocks, plain):
                for p, g in zip(block, gradients):
                    p.grad.copy_(g)
        self._base.step()
        # The core's update (as the C++ dkfac::optim::KFAC applies it) in its two halves: each parameter's sums, then
        # the block's update. A parameter sharded by FSDP2 or HSDP has its sums over its own shard added over the mesh
        # dimensions it is sharded on (not those it is replicated on), so that the norms are the whole layer's: one
        # allreduce per mesh dimension, for every layer together.
        parts = [([_local(p) for p in block], [_local(t) for t in start], [_local(d) for d in direction])
                 for block, start, direction in zip(blocks, before, directions)]
        sums = [_C.graft_sums(*part) if part[0] else None for part in parts]
        rows: dict[tuple, list[tuple[int, int]]] = {}
        for k, block in enumerate(blocks):
            for i, p in enumerate(block):
                dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard()) \
                    if _is_dtensor(p) else ()
                if dims:
                    rows.setdefault((p.device_mesh, dims), []).append((k, i))
        for (mesh, dims), where in rows.items():
            together = torch.stack([sums[k][i] for k, i in where])
            for d in dims:
                torch.distributed.all_reduce(together, group=mesh.get_group(d))
            for (k, i), row in zip(where, together):
                sums[k][i] = row
        for part, block_sums in zip(parts, sums):
            if block_sums is not None:
                _C.graft_apply(*part, block_sums)

    def _eigen_adam_step(self) -> None:
        """eigen_adam: the preconditioner has replaced each preconditioned layer's gradient by Adam's step in its
        K-FAC eigenbasis (the moments are the core's, docs/MATH.md section 8). Each such parameter p of a group
        becomes p (1 - lr weight_decay) - lr d (AdamW's update, weight decay decoupled); the base optimizer steps
        the other parameters as it would without K-FAC: the preconditioned ones have no ``.grad`` during its step,
        so it skips them (and keeps no state for them). The gradients left are the steps d."""
        self._follow_adam_constants()
        self._preconditioner.step()
        self._cost.check(self._preconditioner)
        taken = {id(p) for _, module in self._preconditioner.layers for p in _layer_parameters(module)
                 if p.grad is not None}
        directions: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self._base.param_groups:
            for p in group['params']:
                if id(p) in taken and id(p) not in directions:
                    directions[id(p)] = (p, p.grad)
                    p.grad = None
        try:
            self._base.step()
        finally:
            for p, d in directions.values():
                p.grad = d
        with torch.no_grad():
            for group in self._base.param_groups:
                stepped = [p for p in group['params'] if id(p) in directions]
                if stepped:  # the core's update, as the C++ dkfac::optim::KFAC applies it: element-wise, so a
                    # sharded parameter (FSDP2, tensor parallel) is updated shard by shard with its gradient's shard
                    _C.apply_decoupled_step([_local(p) for p in stepped], [_local(p.grad) for p in stepped],
                                            float(group['lr']), float(group.get('weight_decay', 0.0)))

    def _follow_adam_constants(self) -> None:
        """eigen_adam runs one Adam over every preconditioned layer, in the core, with the betas and eps of the base's
        groups that hold those layers (AdamW's own for the rest): read at each step, so that a scheduler that cycles
        the momentum (OneCycleLR's cycle_momentum) or a group changed by hand is followed as AdamW follows it.
        Groups of preconditioned layers with other betas or eps are refused: the core has one set. A preconditioner
        given adam_beta1, adam_beta2 or adam_eps (or built beforehand) keeps its own."""
        known = self._preconditioned_parameters()
        seen: dict[tuple[float, float, float], int] = {}
        for i, group in enumerate(self._base.param_groups):
            if not any(id(p) in known for p in group['params']):
                continue
            betas = group.get('betas', (0.9, 0.999))
            seen.setdefault((float(betas[0]), float(betas[1]), float(group.get('eps', 1e-8))), i)
        if len(seen) > 1 and self._adam_follows:
            (first, i), (other, j) = list(seen.items())[:2]
            raise ValueError(f'eigen_adam runs one Adam over every preconditioned layer: param groups {i} and {j} '
                             f'hold preconditioned layers with (beta1, beta2, eps) {first} and {other}; give those '
                             'layers one group (or the same betas and eps)')
        if not seen or not self._adam_follows:
            return
        constants = next(iter(seen))
        if constants != self._adam_constants:
            self._preconditioner._core.set_adam_constants(*constants)
            for name, value in zip(('adam_beta1', 'adam_beta2', 'adam_eps'), constants):
                setattr(self._preconditioner, name, value)  # its attributes, as given at construction
            self._adam_constants = constants

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's ``zero_grad``."""
        self._base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds the group to the base optimizer.

        The preconditioner chose its layers when it was built: parameters of the new group that are not in one of
        them are optimized with their plain gradients, with a warning (a layer added or unfrozen since needs a new
        preconditioner to be preconditioned).
        """
        self._base.add_param_group(param_group)
        known = self._preconditioned_parameters()
        added = self._base.param_groups[-1]['params']
        outside = [p for p in added if id(p) not in known]
        if outside:
            warnings.warn(
                f'dkfac.optim.KFAC.add_param_group: {len(outside)} of the {len(added)} parameters of the new group '
                'are not in a layer the preconditioner registered (it chose its layers when it was built), so they '
                'are optimized with their plain gradients. To precondition layers added or unfrozen since, build a '
                'new dkfac.optim.KFAC for the model.', UserWarning, stacklevel=2)

    # --- state -------------------------------------------------------------------------------------------------
    def state_dict(self, gathered: bool | None = None) -> dict[str, Any]:  # type: ignore[override]
        """The base optimizer's ``state_dict()``, whose first parameter group also holds the preconditioner's
        ``state_dict(gathered=gathered)`` under ``'kfac'``.

        A torch optimizer's layout (``'state'``, ``'param_groups'``), so that torch's
        ``torch.distributed.checkpoint.state_dict`` (``get_optimizer_state_dict``, ``set_optimizer_state_dict``, as
        Lightning's ``ModelParallelStrategy`` and accelerate's FSDP2 call them) carries both halves. The
        preconditioner's half is this rank's own state by default: it resumes on as many ranks, each loading its own,
        and through ``torch.distributed.checkpoint`` on any number (each entry written once, by a rank that holds it).
        ``gathered=True`` (collective: every rank calls it) holds every layer's whole K-FAC state, the same on every
        rank, which resumes on any number of ranks and strategy: save it where one rank saves for all (a DP-KFAC job
        resumed from rank 0's file). None: the constructor's ``gathered_state_dict``. ``dkfac.hf.KFACTrainer`` saves
        the gathered state under several processes.
        """
        gathered = self._gathered_state_dict if gathered is None else gathered
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._base.state_dict()
        groups = state_dict['param_groups']
        if any(_KFAC_KEY in group for group in groups):
            raise ValueError(f'dkfac.optim.KFAC.state_dict: a parameter group of the base optimizer has a '
                             f"{_KFAC_KEY!r} entry, where this optimizer keeps the preconditioner's state; rename it")
        groups[0] = {**groups[0], _KFAC_KEY: self._preconditioner.state_dict(gathered=gathered)}
        if self._eigen_adam:
            # The base keeps no state for the preconditioned layers' parameters (their moments are the
            # preconditioner's): an empty entry each, so that torch's strict loading (set_optimizer_state_dict)
            # finds one for every parameter that requires a gradient.
            index = {id(p): i for i, p in enumerate(p for group in self._base.param_groups for p in group['params'])}
            for _, module in self._preconditioner.layers:
                for p in _layer_parameters(module):
                    if id(p) in index:
                        state_dict['state'].setdefault(index[id(p)], {})
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Loads a ``state_dict()`` of a KFAC optimizer: both halves, or (on a refused dict) neither.

        Also the layout earlier versions wrote, ``{'base': base.state_dict(), 'kfac': preconditioner.state_dict()}``.
        The layout and the base's parameter groups are checked first; the preconditioner's half is then loaded
        (it checks its own layers and values before changing anything), then the base's; should the base still
        refuse, the preconditioner's previous state is put back. A following ``lr`` keeps following.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        base, kfac = self._halves(state_dict)
        previous = self._preconditioner.state_dict()  # fresh tensors, not views of the live state
        try:
            self._preconditioner.load_state_dict(kfac)
        except ValueError as error:
            ours = kfac.get('dkfac') if isinstance(kfac.get('dkfac'), Mapping) else {}
            one_ranks = not ours.get('gathered', True) and int(ours.get('world_size', 1)) > 1
            if 'state_dict(gathered=True)' not in str(error) and not (one_ranks and 'holds no entry' in str(error)):
                raise
            job = f"a {ours['world_size']}-rank job" if 'world_size' in ours else 'a job of several ranks'
            raise ValueError(f"{error}. Through dkfac.optim.KFAC: this is one rank's own K-FAC state of {job}; "
                             "build the optimizer with gathered_state_dict=True "
                             "where every rank calls state_dict() and rank 0 saves it for all (Lightning's and "
                             "accelerate's checkpoints under DDP, and their full state dicts under FSDP2), save a "
                             'sharded checkpoint (torch.distributed.checkpoint), or train with dkfac.hf.KFACTrainer'
                             ) from None
        if self._eigen_adam:  # state_dict()'s empty entries of the preconditioned layers' parameters: not the base's
            base = {**base, 'state': {key: value for key, value in base['state'].items()
                                      if not (isinstance(value, Mapping) and not value)}}
        try:
            self._base.load_state_dict(base)
        except BaseException:
            self._preconditioner.load_state_dict(previous)
            self._follow_lr()
            raise
        self._follow_lr()  # a loaded constant lr would otherwise replace the follower
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _halves(self, state_dict: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the base optimizer's state dict, the preconditioner's) of a KFAC optimizer's state dict, checked;
        refuses, naming what is missing or different, a state dict that is not a KFAC optimizer's."""
        where = 'dkfac.optim.KFAC.load_state_dict'
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{where}: expected a dict with 'state' and 'param_groups' (KFAC.state_dict()), got "
                            f'{type(state_dict).__name__}')
        if 'state' in state_dict and 'param_groups' in state_dict:
            groups = state_dict['param_groups']
            if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
                raise ValueError(f"{where}: state_dict['param_groups'] must be a list of parameter groups")
            holding = [i for i, group in enumerate(groups) if _KFAC_KEY in group]
            if not holding:
                raise ValueError(
                    f"{where}: the state dict has a torch optimizer's layout but no K-FAC state (KFAC.state_dict() "
                    f"keeps it in param_groups[0][{_KFAC_KEY!r}]): a plain optimizer's state_dict(), which loads into "
                    'the base optimizer (opt.optimizer.load_state_dict(...)), or one that '
                    "torch.distributed.checkpoint.state_dict flattened (flatten_optimizer_state_dict=True keeps only "
                    "the keys of the live parameter groups): checkpoint the preconditioner as its own entry then, "
                    "dcp.save({..., 'kfac': opt.preconditioner})")
            if len(holding) > 1:
                raise ValueError(f'{where}: parameter groups {holding} each hold a {_KFAC_KEY!r} entry; '
                                 'KFAC.state_dict() writes one')
            base = {**state_dict, 'param_groups': [{k: v for k, v in group.items() if k != _KFAC_KEY}
                                                   for group in groups]}
            kfac = groups[holding[0]][_KFAC_KEY]
        else:
            missing = [key for key in ('base', 'kfac') if key not in state_dict]
            if missing:
                keys = sorted(map(str, state_dict))
                hint = ''
                if 'steps' in state_dict:
                    hint = (" It has the layout of a preconditioner's state_dict(): load that with "
                            'opt.preconditioner.load_state_dict(...).')
                raise ValueError(f"{where}: the state dict has neither 'state' and 'param_groups' "
                                 "(KFAC.state_dict()) nor 'base' and 'kfac' (the layout of earlier versions); "
                                 f'its keys are {keys}.{hint}')
            base, kfac = state_dict['base'], state_dict['kfac']
        for name, part, keys in (('base', base, ('state', 'param_groups')), ('kfac', kfac, ('steps',))):
            if not isinstance(part, Mapping):
                raise TypeError(f"{where}: the {name} optimizer's half must be a dict, got {type(part).__name__}")
            absent = [key for key in keys if key not in part]
            if absent:
                raise ValueError(f"{where}: the {'base optimizer' if name == 'base' else 'K-FAC'} half has no "
                                 f"{' and no '.join(repr(k) for k in absent)} entry (its keys are "
                                 f"{sorted(map(str, part))}); is it a KFAC optimizer's state_dict()?")
        groups, saved = self._base.param_groups, base['param_groups']
        if not isinstance(saved, (list, tuple)) or not all(isinstance(g, Mapping) and 'params' in g for g in saved):
            raise ValueError(f"{where}: the base optimizer's param_groups must be a list of groups with 'params'")
        if len(saved) != len(groups):
            raise ValueError(f'{where}: the state dict holds {len(saved)} parameter groups, the base optimizer '
                             f'has {len(groups)}')
        for index, (group, saved_group) in enumerate(zip(groups, saved)):
            if len(group['params']) != len(saved_group['params']):
                raise ValueError(f'{where}: parameter group {index} of the state dict holds '
                                 f"{len(saved_group['params'])} parameters, the base optimizer's holds "
                                 f"{len(group['params'])}")
        return dict(base), kfac

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError('dkfac.optim.KFAC cannot be pickled or deep-copied (its preconditioner holds hooks and C++ '
                        'state); save and load state_dict() instead')

    def __repr__(self) -> str:
        return (f'{type(self).__name__} (\n'
                f'  optimizer: {_indent(repr(self._base)).lstrip()}\n'
                f'  preconditioner: {_indent(repr(self._preconditioner)).lstrip()}\n'
                f'  kfac_lr_follows: {self._kfac_lr_follows}\n'
                ')')

    # --- helpers -----------------------------------------------------------------------------------------------
    def _preconditioned_parameters(self) -> set[int]:
        ids = set()
        for _, module in self._preconditioner.layers:
            ids.update(id(p) for p in _layer_parameters(module))
        return ids

    def _check_layers_are_optimized(self) -> None:
        """Refuses a preconditioner whose layers the base optimizer does not optimize at all (built for another
        model: K-FAC would be silently off), and warns about the layers it does not optimize."""
        optimized = {id(p) for group in self._base.param_groups for p in group['params']}
        layers = self._preconditioner.layers
        outside = [name for name, module in layers
                   if not any(id(p) in optimized for p in _layer_parameters(module))]
        if layers and len(outside) == len(layers):
            raise ValueError('dkfac.optim.KFAC: none of the preconditioned layers has its parameters in the base '
                             "optimizer's param_groups (the preconditioner and the optimizer were built for different "
                             f'models or parameters?); layers: {outside[:5]}')
        if outside:
            warnings.warn(f'dkfac.optim.KFAC: {len(outside)} preconditioned layer(s) are not optimized by the base '
                          f'optimizer (their parameters are in none of its param_groups): {outside[:5]}',
                          UserWarning, stacklevel=3)

    def _follow_lr(self) -> None:
        if self._kfac_lr_follows:
            # The preconditioner reads its hyper-parameters through these attributes at each step (a number or a
            # callable of the K-FAC step), as dkfac.scheduler.LambdaParamScheduler sets them.
            self._preconditioner._lr = _LrOf(self._base)
