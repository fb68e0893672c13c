"""One rank of a pipeline-parallel job (tests/python/test_pipeline.py): 2 stages built by
torch.distributed.pipelining, `dp` replicas (rank = replica * 2 + stage), each stage preconditioned by its own
KFACPreconditioner over its data-parallel group, KL clipping summed over its replica's stages
(model_parallel_group). Writes each step's gradients of the stage (after K-FAC, before SGD) to `output`.

    pipeline_worker.py OUTPUT '{"schedule": "gpipe" | "1f1b", "dp": 1 | 2, "model": "mlp" | "lm", "mismatch": false,
                                "fsdp": false, "stage_options": {"1": {"kl_clip": null}}}'

The "lm" model is scenarios.TinyLanguageModel (an Embedding, a Conv1D, a LayerNorm and a Linear head: GPT-2's layer
kinds), stage 0 its embedding and Conv1D, stage 1 its LayerNorm and head. With `fsdp` each stage is sharded by
fully_shard over its data-parallel ranks (pp x dp_shard, as torchtitan composes them), and the schedule reduces
its gradients at the last micro-batch.
"""
import json
import sys
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import dkfac
import scenarios

STEPS, MICRO, BATCH = 10, 4, 16  # BATCH per replica
KFAC = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, lr=0.1, kl_clip=0.001,
            factor_dtype='float64', inv_dtype='float64')


def model(kind: str = 'mlp') -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == 'lm':
        return scenarios.TinyLanguageModel().double()
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 5)).double()


def data(step: int, replica: int, kind: str = 'mlp') -> tuple[torch.Tensor, torch.Tensor]:
    if kind == 'lm':  # contiguous: the schedule checks each micro-batch's strides against the first
        return tuple(t.contiguous() for t in scenarios.batch('lm', 100 * step + replica, size=BATCH))
    g = torch.Generator().manual_seed(100 * step + replica)
    return (torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 5, generator=g, dtype=torch.float64))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.int64:  # the language model's next tokens
        return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
    return torch.nn.functional.mse_loss(output, target)


def stage_of(whole: torch.nn.Module, stage: int) -> torch.nn.Sequential:
    if isinstance(whole, scenarios.TinyLanguageModel):
        return (torch.nn.Sequential(whole.wte, whole.c_fc, torch.nn.Tanh()) if stage == 0
                else torch.nn.Sequential(whole.ln, whole.head))
    return whole[:2] if stage == 0 else whole[2:]


def schedule_step(schedule: Any, stage: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of a 2-stage schedule: the first stage feeds the inputs, the last the targets."""
    if stage == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)


def mean_over_replicas(parameters: Iterable[torch.nn.Parameter], group: Any, replicas: int) -> None:
    """The replicas' mean gradient, as DDP would give it (a DTensor's local part for a tensor-parallel layer)."""
    for p in parameters:
        local = p.grad.to_local() if hasattr(p.grad, 'to_local') else p.grad
        dist.all_reduce(local, group=group)
        local /= replicas


def stage_parameters(kind: str, stage: int) -> slice:
    """Which of the whole model's parameters (in its order) stage `stage` holds."""
    if kind == 'lm':  # wte; c_fc's weight and bias | ln's and head's weight and bias
        return slice(0, 3) if stage == 0 else slice(3, 7)
    return slice(0, 2) if stage == 0 else slice(2, 6)


def main() -> None:
    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group('gloo')
    rank = dist.get_rank()
    dp = kwargs['dp']
    replica, stage = divmod(rank, 2)
    # Every rank creates every group, in one order.
    pipelines = [dist.new_group([2 * r, 2 * r + 1]) for r in range(dp)]
    replicas = [dist.new_group(list(range(s, 2 * dp, 2))) for s in range(2)]
    kind = kwargs.get('model', 'mlp')
    part = stage_of(model(kind), stage)
    if kwargs.get('fsdp'):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(part, mesh=init_device_mesh('cpu', (dp, 2), mesh_dim_names=('dp', 'pp'))['dp'])
    accumulation = MICRO + (1 if kwargs.get('mismatch') and rank == 2 else 0)
    options = {**KFAC, **kwargs.get('stage_options', {}).get(str(stage), {})}
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            preconditioner = dkfac.KFACPreconditioner(
                part, accumulation_steps=accumulation * dp, process_group=replicas[stage],
                model_parallel_group=pipelines[replica], **options)
    except (ValueError, RuntimeError) as error:
        torch.save({'error': str(error)}, output)
        dist.destroy_process_group()
        return
    if kwargs.get('mismatch'):  # construction only: stage 0's group refused, stage 1's built
        torch.save({'built': True}, output)
        dist.destroy_process_group()
        return
    schedule = {'gpipe': ScheduleGPipe, '1f1b': Schedule1F1B}[kwargs['schedule']]
    pipeline = schedule(PipelineStage(part, stage, 2, torch.device('cpu'), group=pipelines[replica]), MICRO,
                        loss_fn=loss_fn)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        x, y = data(step, replica, kind)
        optimizer.zero_grad()
        schedule_step(pipeline, stage, x, y)
        if dp > 1 and not kwargs.get('fsdp'):
            mean_over_replicas(part.parameters(), replicas[stage], dp)
        preconditioner.step()
        grads.append([p.grad.full_tensor() if hasattr(p.grad, 'full_tensor') else p.grad.clone()
                      for p in part.parameters()])
        optimizer.step()
    torch.save({'grads': grads, 'stage': stage, 'warnings': [str(w.message) for w in said],
                'sharded': [hasattr(p.grad, 'full_tensor') for p in part.parameters()],
                'state': preconditioner.state_dict()}, output)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
