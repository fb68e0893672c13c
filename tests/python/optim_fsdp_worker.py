"""One rank of a job trained through dkfac.optim.KFAC with eigen_adam (AdamW's decoupled update of each preconditioned
parameter applied to its shard) or with grafting (each layer's norms summed over its shards) on a model sharded by
FSDP2 or HSDP (Gloo, CPU), started by tests/python/workers.py. Argument 2 (JSON): {'placement': sharded_placement,
'mode': 'eigen_adam' or 'graft', 'shard': 'fsdp' or 'hsdp'}. Writes {'parameters': the whole parameters after each
step}. `train` with no group is the one-process reference, on the whole batch."""

from __future__ import annotations

import json
import sys

import torch

import dkfac

BATCH, STEPS = 8, 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).double()


def train(model: torch.nn.Module, rank: int = 0, size: int = 1, mode: str = 'eigen_adam',
          **kwargs) -> list[list[torch.Tensor]]:
    """STEPS steps of AdamW with eigen_adam (or of SGD with momentum, grafted) on this rank's share of each batch;
    the whole parameters after each."""
    if mode == 'eigen_adam':
        base = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        how = {'eigen_adam': True, 'adam_eps': 1e-4}
    else:  # a base whose step is linear in the gradient (AdamW's first steps are sensitive to each entry's rounding)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        how = {'graft': True, 'factor_dtype': torch.float64}
    opt = dkfac.optim.KFAC(model, base, inv_dtype='float64', factor_update_steps=1, inv_update_steps=2, **how,
                           **kwargs)
    share = BATCH // size
    after = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x, y = torch.randn(BATCH, 6, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
        opt.zero_grad()
        (model(x[rank * share:(rank + 1) * share]) - y[rank * share:(rank + 1) * share]).pow(2).mean().backward()
        opt.step()
        after.append([(p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().clone()
                      for p in model.parameters()])
    return after


def main() -> None:
    import torch.distributed as dist

    from distributed_worker import sharded

    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group('gloo')
    rank, size = dist.get_rank(), dist.get_world_size()
    model = sharded(make_model(), kwargs.get('shard', 'fsdp'), size, torch.device('cpu'))
    torch.save({'parameters': train(model, rank, size, kwargs.get('mode', 'eigen_adam'),
                                    sharded_placement=kwargs['placement'])}, output)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
