"""Multiplicative hyper-parameter schedules applied between steps, as ``kfac.scheduler`` does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_PARAMETERS = ('factor_update_steps', 'inv_update_steps', 'damping', 'factor_decay', 'kl_clip', 'lr')
_INTEGER = ('factor_update_steps', 'inv_update_steps')


class LambdaParamScheduler:
    """Multiplies a preconditioner's constant hyper-parameters by ``fn(step)`` at each ``step()``.

    Each ``<name>_lambda`` (``factor_update_steps``, ``inv_update_steps``, ``damping``, ``factor_decay``,
    ``kl_clip``, ``lr``) returns a factor for the step (the preconditioner's ``steps`` unless ``step()``
    is given one); intervals are truncated to int. A parameter already given as a callable cannot also
    be scheduled here (ValueError). Call ``step()`` after ``preconditioner.step()``.
    """

    def __init__(
        self,
        preconditioner: Any,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        self._preconditioner = preconditioner
        given = {
            'factor_update_steps': factor_update_steps_lambda,
            'inv_update_steps': inv_update_steps_lambda,
            'damping': damping_lambda,
            'factor_decay': factor_decay_lambda,
            'kl_clip': kl_clip_lambda,
            'lr': lr_lambda,
        }
        self._lambdas = {name: fn for name, fn in given.items() if fn is not None}
        for name in self._lambdas:
            if callable(getattr(preconditioner, '_' + name)):
                raise ValueError(
                    f'preconditioner.{name} is already a callable and cannot also be '
                    f'scheduled by LambdaParamScheduler ({name}_lambda)',
                )

    def step(self, step: int | None = None) -> None:
        """Applies every factor for `step` (default: the preconditioner's steps)."""
        at = self._preconditioner.steps if step is None else step
        for name in _PARAMETERS:
            fn = self._lambdas.get(name)
            if fn is None:
                continue
            attribute = '_' + name
            value = getattr(self._preconditioner, attribute) * fn(at)
            setattr(self._preconditioner, attribute, int(value) if name in _INTEGER else value)
