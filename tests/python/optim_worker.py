"""One rank of a 2-rank DP-KFAC job trained through dkfac.optim.KFAC under DDP (Gloo, CPU), started by
tests/python/workers.py, checkpointed as Lightning and accelerate do under DDP: every rank calls opt.state_dict(), and
rank 0's is the checkpoint every rank loads. Argument 2 (JSON): the KFAC keywords. Writes {'continued': the
gradients of one more step of the job, 'resumed': those of a fresh job that loaded rank 0's state, 'error': the
load's error, or ''}."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

import dkfac
import scenarios


def main() -> None:
    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group('gloo')
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(scenarios.make_model('cnn'))
    opt = dkfac.optim.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy='dp', **kwargs)

    def step(model: torch.nn.Module, opt: dkfac.optim.KFAC, index: int) -> list[torch.Tensor]:
        x, y = scenarios.batch('cnn', index, size=16)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rank * 8:(rank + 1) * 8]), y[rank * 8:(rank + 1) * 8]).backward()
        opt.step()
        return [p.grad.clone() for p in model.parameters()]

    for index in range(3):
        step(model, opt, index)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, opt.state_dict())  # every rank calls it; rank 0's is saved for all
    twin = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model.module))
    twin_opt = dkfac.optim.KFAC(twin, torch.optim.SGD(twin.parameters(), lr=0.1), strategy='dp', **kwargs)
    result = {'error': ''}
    try:
        twin_opt.load_state_dict(states[0])
    except ValueError as error:
        result['error'] = str(error)
    result['continued'] = step(model, opt, 3)
    if not result['error']:
        result['resumed'] = step(twin, twin_opt, 3)
    torch.save(result, output)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
