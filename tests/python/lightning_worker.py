"""One rank of a PyTorch Lightning job under ModelParallelStrategy (FSDP2 over every rank, Gloo, CPU), started by
tests/python/workers.py as torchrun would start it: fits a float64 MLP for 6 steps with dkfac.optim.KFAC; then a
second fit runs 3 steps and saves a checkpoint (the strategy's: torch.distributed.checkpoint.state_dict, sharded or
full), and a third, from a fresh module and optimizer, resumes from it to step 6.

Argument 2 (JSON): 'dir', 'kfac' (dkfac.optim.KFAC's keywords) and 'distributed' (the strategy's
save_distributed_checkpoint). Writes {'full': the first fit's parameters, 'resumed': the third's (None where the
resume raised), 'error': the resume's error (a refusal, or a
peer's loss where that peer refused first), or '', 'steps': the third preconditioner's step count}. Each step's batch
is drawn from the step and the rank, so that the resumed fit sees the uninterrupted one's batches whatever Lightning's
loader does at a resume."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

os.environ.update(TORCHELASTIC_RUN_ID='dkfac-test', LOCAL_RANK=os.environ['RANK'], GROUP_RANK='0',
                  LOCAL_WORLD_SIZE=os.environ['WORLD_SIZE'])  # what torchrun sets, from which Lightning starts no ranks

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import dkfac.optim  # noqa: E402

STEPS = 6


class Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return index


class Module(pl.LightningModule):
    def __init__(self, kfac: dict) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                       torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
        self.kfac = kfac

    def configure_model(self) -> None:
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.device_mesh['data_parallel'])
        fully_shard(self.net, mesh=self.device_mesh['data_parallel'])

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x = torch.randn(4, 8, generator=generator, dtype=torch.float64)
        y = torch.randn(4, 4, generator=generator, dtype=torch.float64)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> dkfac.optim.KFAC:
        # With momentum: Lightning's full checkpoint of a stateless optimizer (plain SGD) fails in Lightning itself.
        return dkfac.optim.KFAC(self.net, torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9), **self.kfac)


def fit(kwargs: dict, steps: int, checkpoint: str | None = None) -> tuple[pl.Trainer, Module]:
    strategy = ModelParallelStrategy(data_parallel_size=int(os.environ['WORLD_SIZE']), tensor_parallel_size=1,
                                     process_group_backend='gloo', save_distributed_checkpoint=kwargs['distributed'])
    trainer = pl.Trainer(accelerator='cpu', devices=int(os.environ['WORLD_SIZE']), strategy=strategy,
                         max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=kwargs['dir'])
    module = Module(kwargs['kfac'])
    trainer.fit(module, torch.utils.data.DataLoader(Indices(), batch_size=4), ckpt_path=checkpoint)
    return trainer, module


def parameters(module: Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in module.net.parameters()]


def main() -> None:
    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    warnings.simplefilter('ignore')
    _, uninterrupted = fit(kwargs, STEPS)
    result = {'full': parameters(uninterrupted), 'resumed': None, 'error': '', 'steps': None}
    checkpoint = os.path.join(kwargs['dir'], 'checkpoint')
    first, _ = fit(kwargs, STEPS // 2)
    first.save_checkpoint(checkpoint)
    try:
        second, resumed = fit(kwargs, STEPS, checkpoint)
        result.update(resumed=parameters(resumed), steps=second.optimizers[0].preconditioner.steps)
    except (ValueError, RuntimeError) as error:  # a refusal; or, on a rank whose peer refused first, its loss
        result['error'] = str(error)
    torch.save(result, output)


if __name__ == '__main__':
    main()
