"""Callbacks that log K-FAC's own time per phase beside the loss: Hugging Face's ``Trainer`` and PyTorch Lightning.

Each finds the ``dkfac.optim.KFAC`` (or a preconditioner) the framework steps, and logs, under ``kfac/<phase>_s``
(factors, second_order, precondition, apply, communication) and ``kfac/total_s``, the mean seconds per step of each
phase since its last log (``phase_times(total=True)``'s growth divided by the steps taken; wall-clock time on a CPU,
CUDA events' time on a GPU, where reading waits for the last step's work). The frameworks themselves are imported
only by the callback of each, when it is made.

    trainer = transformers.Trainer(..., optimizers=(opt, scheduler))
    dkfac.callbacks.add_phase_times(trainer)       # first among its callbacks: its reporters see the phase times
    pl.Trainer(..., callbacks=[dkfac.callbacks.LightningPhaseTimes()])
"""

from __future__ import annotations

import importlib.util
from typing import Any

from dkfac.base_preconditioner import BaseKFACPreconditioner


def _preconditioner_of(optimizer: Any) -> BaseKFACPreconditioner | None:
    """The preconditioner behind ``optimizer``: a dkfac.optim.KFAC, inside accelerate's AcceleratedOptimizer or
    Lightning's wrappers (``.optimizer``), or a preconditioner itself."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, BaseKFACPreconditioner):
            return optimizer
        preconditioner = getattr(optimizer, 'preconditioner', None)
        if isinstance(preconditioner, BaseKFACPreconditioner):
            return preconditioner
        optimizer = getattr(optimizer, 'optimizer', None)
    return None


class _PhaseMeans:
    """The mean seconds per step of each K-FAC phase since the last read."""

    def __init__(self, preconditioner: BaseKFACPreconditioner | None) -> None:
        self.preconditioner = preconditioner
        self.totals: dict[str, float] = {}
        self.steps = 0

    def read(self) -> dict[str, float]:
        preconditioner = self.preconditioner
        if preconditioner is None or preconditioner.steps <= self.steps:
            return {}
        totals = preconditioner.phase_times(total=True)
        steps = preconditioner.steps - self.steps
        means = {f'kfac/{phase}_s': (seconds - self.totals.get(phase, 0.0)) / steps for phase, seconds in totals.items()}
        means['kfac/total_s'] = sum(means.values())
        self.totals, self.steps = totals, preconditioner.steps
        return means


def TrainerPhaseTimes(preconditioner: Any = None) -> Any:  # noqa: N802 (a class, made when transformers is there)
    """A ``transformers.TrainerCallback`` that adds K-FAC's phase times to every training log of the ``Trainer`` (its
    ``logging_steps``): in ``trainer.state.log_history``, and in what the callbacks after it see. The Trainer puts
    its reporters (``report_to``: TensorBoard, W&B, ...) before the callbacks it is given: ``add_phase_times(trainer)``
    puts this one first, so that they report the phase times too. ``preconditioner``:
    a dkfac.optim.KFAC or a preconditioner; by default the one the Trainer steps (its optimizer)."""
    import transformers

    class _TrainerPhaseTimes(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.means = _PhaseMeans(_preconditioner_of(preconditioner))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs is None or 'loss' not in logs:  # a training log, not evaluation's or the run summary's
                return
            if self.means.preconditioner is None:
                self.means.preconditioner = _preconditioner_of(kwargs.get('optimizer'))
            means = self.means.read()
            logs.update(means)  # what the loggers after this callback report
            if state.log_history and state.log_history[-1].get('loss') == logs['loss']:
                state.log_history[-1].update(means)  # the Trainer's copy, taken before the callbacks ran

    return _TrainerPhaseTimes()


def add_phase_times(trainer: Any, preconditioner: Any = None) -> Any:
    """Puts a TrainerPhaseTimes first among a ``transformers.Trainer``'s callbacks (before its reporters), and
    returns it."""
    callback = TrainerPhaseTimes(preconditioner)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def LightningPhaseTimes(preconditioner: Any = None, package: str | None = None) -> Any:  # noqa: N802
    """A PyTorch Lightning ``Callback`` that logs K-FAC's phase times after every training batch whose step the
    ``Trainer`` logs (its ``log_every_n_steps``), through ``LightningModule.log_dict`` (so every logger, and
    ``trainer.callback_metrics``, has them). ``preconditioner``: by default the one the Trainer's optimizer holds.
    ``package``: the Lightning the Trainer comes from, ``'pytorch_lightning'`` or ``'lightning.pytorch'`` (a
    Trainer takes the callbacks of its own package only); by default ``pytorch_lightning`` where it is installed."""
    if package is None:
        package = 'pytorch_lightning' if importlib.util.find_spec('pytorch_lightning') else 'lightning.pytorch'
    pl = importlib.import_module(package)

    class _LightningPhaseTimes(pl.Callback):
        def __init__(self) -> None:
            self.means = _PhaseMeans(_preconditioner_of(preconditioner))

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
            if self.means.preconditioner is None and trainer.optimizers:
                self.means.preconditioner = _preconditioner_of(trainer.optimizers[0])
            if (trainer.global_step % max(1, trainer.log_every_n_steps)) != 0:
                return
            means = self.means.read()
            if means:
                module.log_dict(means, on_step=True, on_epoch=False)

    return _LightningPhaseTimes()
