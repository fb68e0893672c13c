"""Ready-made hyper-parameter schedules (``kfac.hyperparams``)."""

from __future__ import annotations

from collections.abc import Callable


def exp_decay_factor_averaging(min_value: float = 0.95) -> Callable[[int], float]:
    """Factor decay ``min(1 - 1/k, min_value)`` at K-FAC step k (k = 0 counts as 1).

    The running average then weighs the first batches as a plain mean (Martens and Grosse, 2015).
    Pass it as ``factor_decay``.
    """
    if min_value <= 0:
        raise ValueError(f'min_value must be > 0, got {min_value}')

    def decay(step: int) -> float:
        if step < 0:
            raise ValueError(f'step must be >= 0, got {step}')
        return min(1 - 1 / max(step, 1), min_value)

    return decay
