"""One rank of a dkfac.hf.KFACTrainer job under DDP (Gloo, CPU), started by tests/python/workers.py: trains a tiny
GPT-2 for 6 steps, checkpointing at step 3, then a second Trainer resumes from that checkpoint and trains to step 6.
Argument 2 (JSON): 'dir' (the Trainer's output_dir) and 'kfac' (the KFACTrainer's kfac keywords). Writes {'full':
the first run's parameters, 'resumed': the second's, 'error': the resume's error, or ''}."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import transformers

from dkfac.hf import KFACTrainer


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(64, (12,), generator=torch.Generator().manual_seed(index))
        return {'input_ids': ids, 'labels': ids}


def trainer(directory: str, kfac: dict) -> KFACTrainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     tie_word_embeddings=False)
    args = transformers.TrainingArguments(output_dir=directory, max_steps=6, save_steps=3, per_device_train_batch_size=4,
                                          use_cpu=True, ddp_backend='gloo', report_to=[], seed=0, data_seed=0,
                                          learning_rate=1e-3, dataloader_num_workers=0)
    return KFACTrainer(model=transformers.GPT2LMHeadModel(config).double(), args=args, train_dataset=Tokens(),
                       kfac=kfac)


def main() -> None:
    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    os.environ['LOCAL_RANK'] = os.environ['RANK']  # as torchrun sets it, which the Trainer reads
    warnings.simplefilter('ignore')
    first = trainer(kwargs['dir'], kwargs['kfac'])
    first.train()
    result = {'full': [p.detach().clone() for p in first.model.parameters()], 'error': ''}
    second = trainer(kwargs['dir'], kwargs['kfac'])
    try:
        second.train(resume_from_checkpoint=os.path.join(kwargs['dir'], 'checkpoint-3'))
        result['resumed'] = [p.detach().clone() for p in second.model.parameters()]
    except ValueError as error:
        result['error'] = str(error)
    torch.save(result, output)


if __name__ == '__main__':
    main()
