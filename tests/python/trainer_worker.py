"""One rank of a dkfac.hf.KFACTrainer job under DDP (Gloo, CPU), started by tests/python/workers.py: trains a tiny
GPT-2 for 6 steps, checkpointing at step 3, then a second Trainer resumes from that checkpoint and trains to step 6.
Argument 2 (JSON): 'dir' (the Trainer's output_dir), 'kfac' (the KFACTrainer's kfac keywords) and 'fsdp' (true: the
Trainer's FSDP2 path, FullyShardedKFACTrainer, in place of DDP). Writes {'full': the first run's parameters, 'resumed':
the second's, 'error': the resume's error, or '', 'sharded': whether the Trainer's model was FSDP2-sharded}."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import transformers

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dkfac.hf import KFACTrainer


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(64, (12,), generator=torch.Generator().manual_seed(index))
        return {'input_ids': ids, 'labels': ids}


class FullyShardedKFACTrainer(KFACTrainer):
    """A KFACTrainer whose accelerator runs FSDP2. accelerate makes FSDP on accelerators only (a CPU job is
    MULTI_CPU), so its state is turned to FSDP with an FSDP2 plugin once the Trainer has built it: the Trainer's FSDP2
    path then runs on Gloo, as it runs on GPUs. That path is accelerate's fully_shard of each GPT2Block and of the
    root, its swap of the optimizer's parameters for the sharded ones, and its sharded checkpoints through torch's
    distributed state-dict API and DCP."""

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.utils import DistributedType
        from accelerate.utils import FullyShardedDataParallelPlugin
        super().create_accelerator_and_postprocess()
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy='transformer_based_wrap', transformer_cls_names_to_wrap=['GPT2Block'],
            state_dict_type='SHARDED_STATE_DICT')
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.is_fsdp_enabled = True


def trainer(directory: str, kfac: dict, fsdp: bool = False) -> KFACTrainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     tie_word_embeddings=False)
    args = transformers.TrainingArguments(output_dir=directory, max_steps=6, save_steps=3, per_device_train_batch_size=4,
                                          use_cpu=True, ddp_backend='gloo', report_to=[], seed=0, data_seed=0,
                                          learning_rate=1e-3, dataloader_num_workers=0)
    kind = FullyShardedKFACTrainer if fsdp else KFACTrainer
    return kind(model=transformers.GPT2LMHeadModel(config).double(), args=args, train_dataset=Tokens(), kfac=kfac)


def whole(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, each whole (an FSDP2 shard gathered)."""
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def main() -> None:
    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    os.environ['LOCAL_RANK'] = os.environ['RANK']  # as torchrun sets it, which the Trainer reads
    warnings.simplefilter('ignore')
    fsdp = kwargs.get('fsdp', False)
    first = trainer(kwargs['dir'], kwargs['kfac'], fsdp)
    first.train()
    result = {'full': whole(first.model), 'error': '', 'sharded': isinstance(first.model, FSDPModule)}
    second = trainer(kwargs['dir'], kwargs['kfac'], fsdp)
    try:
        second.train(resume_from_checkpoint=os.path.join(kwargs['dir'], 'checkpoint-3'))
        result['resumed'] = whole(second.model)
    except ValueError as error:
        result['error'] = str(error)
    torch.save(result, output)


if __name__ == '__main__':
    main()
