"""One rank of test_distributed.py: trains the "cnn" scenario under torch.distributed (gloo) with DDP and
dkfac, on this rank's shard of each global batch, and saves every step's preconditioned gradients.

Arguments: OUTPUT JSON-KWARGS (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment). Besides the
preconditioner's keyword arguments, JSON-KWARGS may hold 'model' (a scenarios.make_model kind, default 'cnn';
'lm': the layer kinds of a transformer), 'device' ('cpu' or 'cuda': every rank on cuda:0),
'backend' (torch.distributed's, default 'gloo') and 'per_rank' ({"RANK": {keyword: value}}: this rank's own
values). A worker whose preconditioner refuses to be built prints "refused: MESSAGE" and exits with 3; one whose
step() refuses, "refused at step N: MESSAGE", and exits with 4. 'die_at' ({"RANK": step}) makes that rank exit
(status 9, no cleanup) after that step's backward. 'shard' ('fsdp' or 'hsdp') shards the model with FSDP2's
fully_shard (every leaf, then the root; HSDP on a (P/2) x 2 replicate x shard mesh) instead of DDP; with
'shard_after' true, once the preconditioner is built.
'skip_at' ({"RANK": [steps]}) adds a residual Conv2d block
that this rank skips at those steps (stochastic depth), under DDP with find_unused_parameters=True.
'param_dtype' (with 'shard': FSDP2's
MixedPrecisionPolicy computes in that dtype, e.g. 'bfloat16'). With 'accumulation_steps' k each rank's
shard runs as k micro-batches, its gradient reduced after the last only (DDP's no_sync, FSDP2's
set_requires_gradient_sync(False) before). 'dcp_save' ({'dir': D, 'after': k}) checkpoints the model, the optimizer and the preconditioner with
torch.distributed.checkpoint after step k (and its state_dict(gathered=True) as 'saved_gathered'); 'dcp_load'
({'dir': D, 'at': k}) loads such a checkpoint into a freshly built job (its K-FAC state as 'loaded') and trains
steps k to the end, so 'grads' and 'params' start at step k.
"""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any
import os
import sys
import warnings

import torch
import torch.distributed as dist

import dkfac
import scenarios

GLOBAL_BATCH = 16
STEPS = 4


class SkippableBlock(torch.nn.Module):
    """x + relu(conv(x)), or x alone while ``skip`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else x + torch.relu(self.conv(x))


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's whole value (FSDP2's sharded parameters and gradients), a plain tensor as it is; on the CPU.
    None (a gradient of a layer no rank ran) stays None."""
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, 'full_tensor') else t).detach().to('cpu', copy=True)


def sharded(model: torch.nn.Module, how: str, size: int, device: torch.device,
            param_dtype: str | None = None) -> torch.nn.Module:
    """``model`` under FSDP2: every leaf with parameters sharded on its own, then the root; 'hsdp' on a
    (size / 2) x 2 mesh ('hsdp3': (size / 3) x 3), replicated over the first dimension and sharded over the second.
    With `param_dtype`, FSDP2's MixedPrecisionPolicy computes in that dtype and reduces gradients in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

    shards = 3 if how == 'hsdp3' else 2
    shape, names = ((size,), ('shard',)) if how == 'fsdp' else ((size // shards, shards), ('replicate', 'shard'))
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    policy = {} if param_dtype is None else {'mp_policy': MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)}
    for module in model.modules():
        if module is not model and not any(True for _ in module.children()) and any(True for _ in module.parameters()):
            fully_shard(module, mesh=mesh, **policy)
    return fully_shard(model, mesh=mesh, **policy)


def main() -> None:
    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    explicit_group = kwargs.pop('explicit_group', False)
    resume = kwargs.pop('resume', None)  # 'own' or 'rank0': reload a state dict after the run, one more step
    save_gathered = kwargs.pop('save_gathered', False)  # also save state_dict(gathered=True) and state_dict()
    # Options of two twins built after the run: one loads each rank's own state_dict(), the other the gathered one;
    # their states as loaded and their gradients at one more step are saved ('resumed_as')
    # (with 'stale': rank 1's own state is one step older, and the error each rank raises is saved instead)
    resume_as = kwargs.pop('resume_as', None)
    stale = resume_as is not None and resume_as.pop('stale', False)
    # (with 'broken_on': r, rank r's own state lacks its first layer's entry, which its checks refuse before any
    # collective)
    broken_on = None if resume_as is None else resume_as.pop('broken_on', None)
    device = torch.device(kwargs.pop('device', 'cpu'))
    kind = kwargs.pop('model', 'cnn')  # a scenarios.make_model kind
    dist.init_process_group(kwargs.pop('backend', 'gloo'))
    rank, size = dist.get_rank(), dist.get_world_size()
    skip_at = kwargs.pop('skip_at', None)
    # {'step': k, 'layer': i}: the i-th Linear's weight frozen from step k on (its bias trained), gradients zeroed in
    # place (zero_grad(set_to_none=False)) at every step
    freeze = kwargs.pop('freeze_weight_at', None)
    sharding = kwargs.pop('shard', None)  # 'fsdp' (1-D mesh), 'hsdp' or 'hsdp3' (2-D: replicate x shard): FSDP2
    shard_after = kwargs.pop('shard_after', False)  # fully_shard once the preconditioner is built
    dcp_save, dcp_load = kwargs.pop('dcp_save', None), kwargs.pop('dcp_load', None)
    param_dtype = kwargs.pop('param_dtype', None)  # FSDP2's MixedPrecisionPolicy(param_dtype=...)
    steps = kwargs.pop('steps', STEPS)  # training steps run
    backend = kwargs.pop('compile', None)  # torch.compile the model (this backend) once the preconditioner hooks it
    accumulate = kwargs.get('accumulation_steps', 1)  # micro-batches per step, gradients reduced after the last
    if sharding is not None:
        model = scenarios.make_model(kind).to(device)
        if skip_at is not None:  # the block is skipped by every rank alike at the steps of skip_at['0']
            skipping = set(skip_at['0'])
            block = SkippableBlock()
            model = torch.nn.Sequential(model[0], model[1], block, *model[2:]).to(device)
        if not shard_after:
            model = sharded(model, sharding, size, device, param_dtype)
    elif skip_at is None:
        model = torch.nn.parallel.DistributedDataParallel(scenarios.make_model(kind).to(device))
    else:
        skipping = set(skip_at.get(str(rank), []))
        block = SkippableBlock()
        base = scenarios.make_model('cnn')
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(base[0], base[1], block, *base[2:]).to(device), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if explicit_group:
        kwargs['process_group'] = dist.new_group(list(range(size)))
    kwargs.update(kwargs.pop('per_rank', {}).get(str(rank), {}))
    die_at = kwargs.pop('die_at', {}).get(str(rank))  # this rank ends abruptly before that step's K-FAC step
    with warnings.catch_warnings(record=True) as caught:  # the workers run with PYTHONWARNINGS=ignore
        warnings.simplefilter('always')
        try:
            preconditioner = dkfac.KFACPreconditioner(model, **kwargs)
        except (RuntimeError, ValueError) as error:
            print(f'refused: {error}', flush=True)
            sys.exit(3)
    if shard_after:
        model = sharded(model, sharding, size, device, param_dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graphs = []  # what Dynamo compiled: one entry per graph handed to the backend

    def counted(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(len(graph.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    run = model
    if backend is not None and sharding is not None:
        # Each FSDP2 module's forward, as torchtitan compiles its blocks: compiling the root module itself compiles
        # nothing under FSDP2 (its hooks are dynamo-disabled, and the children run eagerly after that break).
        from torch.distributed.fsdp import FSDPModule
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.forward = torch.compile(module.forward, backend=counted)
    elif backend is not None:
        run = torch.compile(model, backend=counted)
    layout = {'distributed_strategy': preconditioner.distributed_strategy.name,
              'grad_worker_fraction': preconditioner.grad_worker_fraction,
              'colocate_factors': preconditioner.colocate_factors}
    shard = GLOBAL_BATCH // size
    grads, params, extra = [], [], {}
    if dcp_load:
        from torch.distributed import checkpoint as dcp
        state = {'model': model.state_dict(), 'optim': optimizer.state_dict(), 'kfac': preconditioner}
        dcp.load(state, checkpoint_id=dcp_load['dir'])
        model.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optim'])
        extra['loaded'] = copy.deepcopy(preconditioner._core.layer_states())  # live tensors: as loaded
    for step in range(dcp_load['at'] if dcp_load else 0, steps):
        if skip_at is not None:
            block.skip = step in skipping
        params.append([full(p) for p in model.parameters()])
        x, y = (t.to(device) for t in scenarios.batch(kind, step, size=GLOBAL_BATCH))
        if freeze is not None and step == freeze['step']:
            [m for m in model.modules() if isinstance(m, torch.nn.Linear)][freeze['layer']].weight.requires_grad_(False)
        optimizer.zero_grad(set_to_none=freeze is None)
        mine = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        for j, (mx, my) in enumerate(zip(*(t.chunk(accumulate) for t in mine))):
            last = j == accumulate - 1  # gradients are reduced after the last micro-batch only
            if sharding is not None:
                model.set_requires_gradient_sync(last)
            with model.no_sync() if sharding is None and not last else contextlib.nullcontext():
                (scenarios.loss_of(kind, run(mx), my) / accumulate).backward()
        if die_at == step:
            os._exit(9)
        try:
            preconditioner.step()
        except RuntimeError as error:
            if not any(m in str(error) for m in ('the ranks\' hyper-parameters differ', 'before step() at step',
                                                 'every rank stops here')):
                raise
            print(f'refused at step {step}: {error}', flush=True)
            sys.exit(4)
        grads.append([full(p.grad) for p in model.parameters()])
        optimizer.step()
        if stale and step == steps - 2:
            older = preconditioner.state_dict()
        if dcp_save and step == dcp_save['after']:
            from torch.distributed import checkpoint as dcp
            dcp.save({'model': model.state_dict(), 'optim': optimizer.state_dict(), 'kfac': preconditioner},
                     checkpoint_id=dcp_save['dir'])
            extra['saved_gathered'] = copy.deepcopy(preconditioner.state_dict(gathered=True))  # as saved
    if backend is not None:
        extra['compiled_graphs'] = len(graphs)
    if save_gathered:
        extra.update(gathered=preconditioner.state_dict(gathered=True), own=preconditioner.state_dict())
    if resume:
        states = [None] * size
        dist.all_gather_object(states, preconditioner.state_dict())
        twin = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model.module))
        twin_preconditioner = dkfac.KFACPreconditioner(twin, **kwargs)
        twin_preconditioner.load_state_dict(states[rank] if resume == 'own' else states[0])
        x, y = scenarios.batch('cnn', STEPS, size=GLOBAL_BATCH)
        after = []
        for m, p in ((model, preconditioner), (twin, twin_preconditioner)):
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(x[rank * shard:(rank + 1) * shard]),
                                              y[rank * shard:(rank + 1) * shard]).backward()
            p.step()
            after.append([q.grad.clone() for q in m.parameters()])
        extra = {**extra, 'continued': after[0], 'resumed': after[1], 'resumed_steps': twin_preconditioner.steps}
    if resume_as is not None:
        own, gathered = preconditioner.state_dict(), preconditioner.state_dict(gathered=True)
        x, y = scenarios.batch('cnn', STEPS, size=GLOBAL_BATCH)
        twins = {}
        for name, state in (('own', older if stale and rank == 1 else own), ('gathered', gathered)):
            if name == 'own' and broken_on == rank:
                state = {**state, 'layers': dict(list(state['layers'].items())[1:])}
            twin = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model.module))
            twin_preconditioner = dkfac.KFACPreconditioner(twin, **{**kwargs, **resume_as})
            try:
                twin_preconditioner.load_state_dict(state)
            except ValueError as error:
                twins[name] = {'refused': str(error)}
                continue
            loaded = copy.deepcopy(twin_preconditioner._core.layer_states())
            twin.zero_grad()
            torch.nn.functional.cross_entropy(twin(x[rank * shard:(rank + 1) * shard]),
                                              y[rank * shard:(rank + 1) * shard]).backward()
            twin_preconditioner.step()
            twins[name] = {'loaded': loaded, 'grads': [q.grad.clone() for q in twin.parameters()],
                           'plan': twin_preconditioner.plan}
        extra['resumed_as'] = twins
    torch.save({**extra, 'grads': grads, 'params': params, 'layers': [name for name, _ in preconditioner.layers],
                'state': preconditioner.state_dict(), 'plan': preconditioner.plan,
                'memory': preconditioner.memory_usage(),
                'traffic': preconditioner._communicator.traffic(), 'times': preconditioner.phase_times(total=True),
                'predicted_gradient_bytes': preconditioner._core.predicted_gradient_bytes(4),
                'predicted_factor_bytes': preconditioner._core.predicted_factor_bytes(4),
                'choice': preconditioner.strategy_choice, 'layout': layout,
                'warnings': [str(w.message) for w in caught]}, output)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
