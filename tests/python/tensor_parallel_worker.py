"""One rank of a tensor-parallel job (tests/python/test_tensor_parallel.py): `tp` tensor-parallel ranks split the
model with torch.distributed.tensor.parallel, `dp` replicas of that split average their gradients over their
data-parallel group (rank = replica * tp + tp_rank), each rank preconditions its slices with a KFACPreconditioner
over that group. Writes each step's local gradients of the model (after K-FAC, before SGD) to `output`.

    tensor_parallel_worker.py OUTPUT '{"tp": 2, "dp": 1 | 2, "model": "mlp" | "lm", "sequence_parallel": false,
                                       "vocabulary_parallel": false, "fsdp": false, "hsdp": R, "pipeline": false,
                                       "dcp_save": PATH, "dcp_load": PATH, "device": "cpu" | "cuda",
                                       "backend": "gloo" | "nccl", "options": {...}, "zero_in_place": false,
                                       "repeat_step": false, "compile": false, "row_bias": true}'

"mlp": `up` column-parallel, `down` row-parallel (its bias replicated), `head` left whole (every tensor-parallel rank
holds it). "lm": the same after an Embedding whose embedding dimension is split (ColwiseParallel), or with
`vocabulary_parallel` its tokens (RowwiseParallel, torchtitan's split of tok_embeddings). With
`sequence_parallel` the input and the residual stream are sharded on the sequence dimension (SequenceParallel on a
LayerNorm, the split layers' layouts as torchtitan gives them) and the head is column-parallel too. With `fsdp`
the replicas shard the split model with fully_shard (FSDP2 x TP, as torchtitan composes them); with `hsdp` R as
well, HSDP x TP: R replicas of fully_shard over dp / R ranks each (the mesh's dimensions replicate, shard, tp).
With `pipeline`, pp 2 x dp x tp: tower()'s two stages (pipeline_job).
"""
import json
import sys

import torch
import torch.distributed as dist

import dkfac
import pipeline_worker  # its schedule_step and mean_over_replicas

STEPS, BATCH, SEQ, WIDTH, HIDDEN, OUT, VOCAB = 10, 4, 6, 8, 12, 6, 11
MICRO = 2  # the pipeline's micro-batches of a replica's batch
KFAC = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, lr=0.1, kl_clip=0.001,
            factor_dtype='float64', inv_dtype='float64')


class Block(torch.nn.Module):
    """(Embedding ->) LayerNorm -> up -> tanh -> down, a residual, and a head; `down` without its bias where not
    `row_bias` (torchtitan's Llama has none: every tensor-parallel rank's slices are then of one shape)."""

    def __init__(self, kind: str, row_bias: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH) if kind == 'lm' else None
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH, bias=row_bias)
        self.head = torch.nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.head(h)


class Layer(torch.nn.Module):
    """LayerNorm -> up -> tanh -> down, and a residual: a transformer block's MLP half, one per pipeline stage."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h))))


def tower() -> torch.nn.Sequential:
    """Two Layers and a head: stage 0 holds the first Layer, stage 1 the second and the head."""
    torch.manual_seed(0)
    return torch.nn.Sequential(Layer(), Layer(), torch.nn.Linear(WIDTH, OUT)).double()


def model(kind: str, row_bias: bool = True) -> Block:
    torch.manual_seed(0)
    return Block(kind, row_bias).double()


def data(step: int, replica: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + replica)
    x = (torch.randint(VOCAB, (BATCH, SEQ), generator=g) if kind == 'lm'
         else torch.randn(BATCH, SEQ, WIDTH, generator=g, dtype=torch.float64))
    return x, torch.randn(BATCH, SEQ, OUT, generator=g, dtype=torch.float64)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def plan(kind: str, sequence_parallel: bool, vocabulary: bool = False) -> dict:
    """The layers' splits; the "lm" Embedding's by its embedding dimension, or with `vocabulary` by its tokens
    (RowwiseParallel, as torchtitan splits tok_embeddings)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    output = Shard(1) if sequence_parallel else Replicate()
    embed = (RowwiseParallel(input_layouts=Replicate(), output_layouts=output) if vocabulary
             else ColwiseParallel(output_layouts=output))
    if not sequence_parallel:
        layers = {'up': ColwiseParallel(), 'down': RowwiseParallel()}
    else:
        layers = {'norm': SequenceParallel(), 'up': ColwiseParallel(input_layouts=Shard(1)),
                  'down': RowwiseParallel(output_layouts=Shard(1)),
                  'head': ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    if kind == 'lm':
        layers['embed'] = embed
    return layers


def local_input(x: torch.Tensor, tp_rank: int, tp: int, sequence_parallel: bool, kind: str) -> torch.Tensor:
    """What a rank feeds the model: the whole batch, or under sequence parallelism (with a plain first layer) its
    chunk of the sequence."""
    return x.chunk(tp, dim=1)[tp_rank].contiguous() if sequence_parallel and kind != 'lm' else x


def local_gradient(p: torch.nn.Parameter) -> torch.Tensor:
    """This rank's slice of p's gradient: its tensor-parallel part, whole over fully_shard's dimension (a
    sequence-parallel LayerNorm's, a partial sum over the sequence, summed)."""
    grad = p.grad
    if not hasattr(grad, 'to_local'):
        return grad
    from torch.distributed.tensor import Replicate

    kept = [placement if name == 'tp' and not placement.is_partial() else Replicate()
            for name, placement in zip(grad.device_mesh.mesh_dim_names, grad.placements)]
    return grad.redistribute(grad.device_mesh, kept).to_local()


def refusals(output: str) -> None:
    """What dkfac refuses, naming the layer or the option: a model split after the preconditioner was built (at its
    first forward: the layer's input is then a DTensor), owner placement with exact factors, a model_parallel_group
    without the tensor-parallel ranks, an unknown tensor_parallel_factors, a replicated weight (SequenceParallel on a Linear); strategy auto and dp with slices of different sizes, options
    that differ between the tensor-parallel ranks, an empty slice (each on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh('cpu', (dist.get_world_size(),), mesh_dim_names=('tp',))
    errors = {}
    whole = model('mlp')
    kept = dkfac.KFACPreconditioner(whole)  # noqa: F841 (its hooks live with it)
    parallelize_module(whole, mesh, plan('mlp', False))
    try:
        whole(data(0, 0, 'mlp')[0])
    except ValueError as error:
        errors['split after'] = str(error)
    alone = [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    for name, options in (('owner', {'sharded_placement': 'owner', 'tensor_parallel_factors': 'exact'}),
                          ('model group', {'model_parallel_group': alone}),
                          ('factors', {'tensor_parallel_factors': 'blocks'})):
        try:
            dkfac.KFACPreconditioner(parallelize_module(model('mlp'), mesh, plan('mlp', False)), **options)
        except ValueError as error:
            errors[name] = str(error)
    def uneven() -> torch.nn.Module:  # 3 = 2 + 1 features
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))

    for name, options, split in (('dp uneven', {'strategy': 'dp'}, uneven()),
                                 ('auto uneven', {'strategy': 'auto'}, uneven()),
                                 ('dp row bias', {'strategy': 'dp'}, None),
                                 ('options', {'damping': 0.01 * (1 + dist.get_rank())}, None),
                                 ('empty slice', {}, torch.nn.Sequential(torch.nn.Linear(4, 1)))):
        parts = plan('mlp', False) if split is None else {'0': ColwiseParallel()}
        try:
            dkfac.KFACPreconditioner(parallelize_module(split or model('mlp'), mesh, parts), **options)
        except ValueError as error:
            errors[name] = str(error)
    try:  # a Linear under SequenceParallel: its weight replicated, its gradient a partial sum
        dkfac.KFACPreconditioner(parallelize_module(model('mlp'), mesh, {'up': SequenceParallel()}))
    except ValueError as error:
        errors['replicated'] = str(error)
    torch.save(errors, output)


def stage_without_tensor_parallel_layers(output: str) -> None:
    """2 pipeline stages x TP 2 (4 ranks), KL clipping summed over the replica's 4 ranks: stage 0 splits its
    Linear, stage 1 holds a Linear whole on both of its ranks, which would count it twice in the sum. Each rank
    records what building its preconditioner raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'tp'))
    alone = [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    torch.manual_seed(0)
    part = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh())
    if mesh.get_local_rank('pp') == 0:
        parallelize_module(part, mesh['tp'], {'0': ColwiseParallel()})
    try:
        dkfac.KFACPreconditioner(part, process_group=alone, model_parallel_group=dist.group.WORLD)
        torch.save({'built': True}, output)
    except ValueError as error:
        torch.save({'error': str(error)}, output)


def pipeline_job(output: str, kwargs: dict) -> None:
    """pp 2 x dp x tp on one DeviceMesh (torchtitan's order: pp, dp, tp): each stage of tower() split by tensor
    parallelism (its Layer's up column-parallel, down row-parallel, the head whole), optionally sharded by
    fully_shard over dp, run by a 1F1B schedule of MICRO micro-batches; each rank's preconditioner over its
    data-parallel group, KL clipping summed over its replica's stages and tensor-parallel ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp, tp = kwargs['dp'], kwargs['tp']
    mesh = init_device_mesh('cpu', (2, dp, tp), mesh_dim_names=('pp', 'dp', 'tp'))
    model_group = mesh['pp', 'tp']._flatten('model').get_group()
    stage, replica, tp_rank = mesh.get_local_rank('pp'), mesh.get_local_rank('dp'), mesh.get_local_rank('tp')
    whole = tower()
    part = whole[:1] if stage == 0 else whole[1:]  # Sequential slices keep the names: '0', or '1' and '2'
    if stage != kwargs.get('unsplit_stage'):  # a stage left whole holds its layers whole on each place
        parallelize_module(part, mesh['tp'], {f'{stage}.up': ColwiseParallel(), f'{stage}.down': RowwiseParallel()})
    if kwargs.get('fsdp'):
        from torch.distributed.fsdp import fully_shard

        fully_shard(part, mesh=mesh['dp'])
    preconditioner = dkfac.KFACPreconditioner(part, process_group=mesh['dp'].get_group(),
                                              model_parallel_group=model_group, accumulation_steps=MICRO * dp,
                                              **dict(KFAC, **kwargs.get('options', {})))
    schedule = Schedule1F1B(PipelineStage(part, stage, 2, torch.device('cpu'), group=mesh['pp'].get_group()), MICRO,
                            loss_fn=loss_fn)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        x, y = data(step, replica, 'mlp')
        optimizer.zero_grad()
        pipeline_worker.schedule_step(schedule, stage, x, y)
        if dp > 1 and not kwargs.get('fsdp'):
            pipeline_worker.mean_over_replicas(part.parameters(), mesh['dp'].get_group(), dp)
        preconditioner.step()
        grads.append({name: local_gradient(p).clone() for name, p in part.named_parameters()})
        optimizer.step()
    torch.save({'grads': grads, 'stage': stage, 'tp_rank': tp_rank, 'choice': preconditioner.strategy_choice,
                'held': [name for name, entry in preconditioner.state_dict()['layers'].items() if entry]}, output)


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    output, kwargs = sys.argv[1], json.loads(sys.argv[2])
    device = torch.device(kwargs.get('device', 'cpu'))
    dist.init_process_group(kwargs.get('backend', 'gloo'))
    for mode, run in (('refusals', refusals), ('stage_without_tp', stage_without_tensor_parallel_layers),
                      ('pipeline', lambda output: pipeline_job(output, kwargs))):
        if kwargs.get(mode):
            run(output)
            dist.barrier()
            dist.destroy_process_group()
            return
    tp, dp, kind = kwargs['tp'], kwargs['dp'], kwargs.get('model', 'mlp')
    sequence_parallel = kwargs.get('sequence_parallel', False)
    hsdp = kwargs.get('hsdp', 0)
    if hsdp:  # the data-parallel ranks: replicate x shard, flattened into one group for dkfac
        mesh = init_device_mesh(device.type, (hsdp, dp // hsdp, tp), mesh_dim_names=('replicate', 'shard', 'tp'))
        mesh['replicate', 'shard']._flatten('dp')
    else:
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=('dp', 'tp'))
    replica, tp_rank = mesh['dp'].get_local_rank(), mesh.get_local_rank('tp')
    whole = parallelize_module(model(kind, kwargs.get('row_bias', True)).to(device), mesh['tp'],
                               plan(kind, sequence_parallel, kwargs.get('vocabulary_parallel', False)))
    if kwargs.get('fsdp') or hsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(whole, mesh=mesh['replicate', 'shard'] if hsdp else mesh['dp'])
    options = dict(KFAC, **kwargs.get('options', {}))
    try:
        preconditioner = dkfac.KFACPreconditioner(
            whole, **({'process_group': mesh['dp'].get_group()} if kwargs.get('pass_group', True) else {}), **options)
    except (ValueError, RuntimeError) as error:
        torch.save({'error': str(error)}, output)
        dist.destroy_process_group()
        return
    if kwargs.get('dcp_load'):  # a fresh job reads what another one saved: its state, as loaded
        import torch.distributed.checkpoint as dcp

        dcp.load({'kfac': preconditioner}, checkpoint_id=kwargs['dcp_load'])
        torch.save({'tp_rank': tp_rank, 'state': preconditioner.state_dict()}, output)
        dist.barrier()
        dist.destroy_process_group()
        return
    optimizer = torch.optim.SGD(whole.parameters(), lr=0.1)
    forward = torch.compile(whole, backend='aot_eager') if kwargs.get('compile') else whole
    grads = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in data(step, replica, kind))
        optimizer.zero_grad(set_to_none=not kwargs.get('zero_in_place', False))
        loss_fn(forward(local_input(x, tp_rank, tp, sequence_parallel, kind)), y).backward()
        if dp > 1 and not (kwargs.get('fsdp') or hsdp):
            pipeline_worker.mean_over_replicas(whole.parameters(), mesh['dp'].get_group(), dp)
        preconditioner.step()
        grads.append({name: local_gradient(p).cpu().clone() for name, p in whole.named_parameters()})
        optimizer.step()
    repeated = ''
    if kwargs.get('repeat_step'):  # no backward pass since the last step(): refused
        try:
            preconditioner.step()
        except RuntimeError as error:
            repeated = str(error)
    if kwargs.get('dcp_save'):
        import torch.distributed.checkpoint as dcp

        dcp.save({'kfac': preconditioner}, checkpoint_id=kwargs['dcp_save'])
    element = torch.finfo(torch.float64).bits // 8
    torch.save({'grads': grads, 'tp_rank': tp_rank, 'state': preconditioner.state_dict(), 'repeated': repeated,
                'choice': preconditioner.strategy_choice,
                'memory': preconditioner.memory_usage(),
                'traffic': None if preconditioner._communicator is None else preconditioner._communicator.traffic(),
                'predicted_gradient_bytes': preconditioner._core.predicted_gradient_bytes(element),
                'predicted_memory_bytes': preconditioner._core.predicted_memory_bytes(element)}, output)
    dist.barrier()  # every rank done with every collective before the groups go
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
