"""Hugging Face ``transformers`` integration: a ``Trainer`` that keeps its own optimizer choices and adds K-FAC.

``transformers.Trainer(optimizers=(opt, scheduler))`` drops what ``TrainingArguments`` says of the optimizer: its
``optim`` (AdamW and its betas and epsilon), the parameter groups with and without weight decay, ``learning_rate``,
``weight_decay`` and the schedule (``lr_scheduler_type``, ``warmup_steps``). ``KFACTrainer`` lets the Trainer make
all of them as it would, and wraps the optimizer it made in ``dkfac.optim.KFAC``, so that its scheduler drives both::

    from dkfac.hf import KFACTrainer
    trainer = KFACTrainer(model=model, args=transformers.TrainingArguments(..., learning_rate=3e-4),
                          train_dataset=dataset, kfac=dict(factor_update_steps=10, inv_update_steps=100))

``kfac``: the keywords of ``dkfac.optim.KFAC`` (those of ``dkfac.KFACPreconditioner``, ``graft``, ...);
``accumulation_steps`` defaults to the arguments' ``gradient_accumulation_steps``. Importing
this module imports ``transformers``; ``import dkfac`` does not.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import transformers

from dkfac.optim import KFAC


class KFACTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose optimizer is the one it makes from its ``TrainingArguments``, wrapped in
    ``dkfac.optim.KFAC(model, optimizer, **kfac)``. Everything else is the Trainer's (``optimizers=`` given
    explicitly wins, as in the Trainer: then nothing is wrapped)."""

    def __init__(self, *args: Any, kfac: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.kfac_keywords = dict(kfac or {})
        super().__init__(*args, **kwargs)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        made_here = self.optimizer is None  # not given through optimizers=
        optimizer = super().create_optimizer(*args, **kwargs)
        if made_here and optimizer is not None and not isinstance(optimizer, KFAC):
            # The Trainer's micro-batches per step are the preconditioner's (unless given): each factor update
            # averages them, without a warning, and folds them in the hooks. Its loss scale (fp16: accelerate's
            # GradScaler) is the preconditioner's, which divides G by it.
            keywords = {'accumulation_steps': self.args.gradient_accumulation_steps}
            if getattr(self.accelerator, 'scaler', None) is not None:
                keywords['grad_scaler'] = self.accelerator.scaler
            keywords |= self.kfac_keywords
            self.optimizer = KFAC(self.model, optimizer, **keywords)
        return self.optimizer

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Under several processes (DDP), the Trainer saves rank 0's ``optimizer.state_dict()`` alone, whose K-FAC
        half is then rank 0's own state: it lacks what the other ranks hold (DP-KFAC's factors of their layers,
        KAISA's second-order parts, eigen_adam's moments), and a resume refused it or recomputed them. Every rank
        gathers the whole K-FAC state here (collective), and the Trainer saves that from rank 0: it resumes exactly,
        on any number of ranks and strategy."""
        optimizer = self.optimizer  # accelerate's AcceleratedOptimizer around the KFAC, once prepared
        optimizer = optimizer if isinstance(optimizer, KFAC) else getattr(optimizer, 'optimizer', None)
        if (not isinstance(optimizer, KFAC) or self.args.world_size <= 1 or self.is_deepspeed_enabled
                or self.is_fsdp_enabled):
            return super()._save_optimizer_and_scheduler(output_dir)
        with _saving(optimizer, optimizer.state_dict(gathered=True)):
            return super()._save_optimizer_and_scheduler(output_dir)


@contextlib.contextmanager
def _saving(optimizer: KFAC, state: dict[str, Any]) -> Iterator[None]:
    """``optimizer.state_dict()`` returns `state` (computed on every rank) while the Trainer saves it."""
    optimizer.state_dict = lambda *args, **kwargs: state  # type: ignore[method-assign]
    try:
        yield
    finally:
        del optimizer.state_dict
