"""dkfac under torch.distributed (gloo, DDP) against a single-process reference, for every strategy.

Each run starts P worker processes (tests/python/distributed_worker.py) that train the "cnn" scenario on
their shards of each global batch. KAISA (every grad-worker fraction) and SPD-KFAC must equal one process
whose factors average the per-shard factors and whose gradient averages the per-shard gradients (the
shards as accumulation micro-batches, gradients divided by P); DP-KFAC must equal, layer by layer, one
process whose factors come from the layer owner's shard only.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import dkfac
import scenarios
import workers
from workers import outputs_of

HERE = os.path.dirname(os.path.abspath(__file__))
GLOBAL_BATCH, STEPS = 16, 4
COMMON = dict(factor_update_steps=1, inv_update_steps=2, damping=0.003, lr=0.1)


start_workers = functools.partial(workers.start_workers, 'distributed_worker.py')
run_workers = functools.partial(workers.run_workers, 'distributed_worker.py')


def reference(size: int, kwargs: dict, factor_shard: int | None = None,
              teacher: list | None = None, resize: tuple[int, int] | None = None) -> list[list[torch.Tensor]]:
    """One process: factors from every shard (as micro-batches) or only from `factor_shard`; averaged gradient.

    With `teacher` (the distributed run's parameters before each step) every step starts from those
    parameters instead of the reference's own trajectory. With `resize` (step, size) the job continues from
    that step on that many shards (a checkpoint resumed on another world size): a preconditioner with that
    many micro-batches takes over the state, through this process's own state_dict().
    """
    kind = kwargs.get('model', 'cnn')
    model = scenarios.make_model(kind)
    plain = copy.deepcopy(model)  # computes the averaged gradient without capturing
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {k: v for k, v in kwargs.items()
              if k not in ('strategy', 'grad_worker_fraction', 'spd_redundant_dim', 'model')}
    micro = size if factor_shard is None else 1
    preconditioner = dkfac.KFACPreconditioner(model, accumulation_steps=micro, **kwargs)
    shard = GLOBAL_BATCH // size
    grads = []
    for step in range(STEPS):
        if resize is not None and step == resize[0]:
            size, shard = resize[1], GLOBAL_BATCH // resize[1]
            state = preconditioner.state_dict()
            preconditioner = None  # one preconditioner per model
            preconditioner = dkfac.KFACPreconditioner(model, accumulation_steps=size, **kwargs)
            preconditioner.load_state_dict(state)
        if teacher is not None:
            with torch.no_grad():
                for p, t in zip(model.parameters(), teacher[step]):
                    p.copy_(t)
        x, y = scenarios.batch(kind, step, size=GLOBAL_BATCH)
        parts = [(x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard]) for r in range(size)]
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        for px, py in parts:
            scenarios.loss_of(kind, plain(px), py).backward()
        optimizer.zero_grad()
        for px, py in parts if factor_shard is None else [parts[factor_shard]]:
            scenarios.loss_of(kind, model(px), py).backward()
        with torch.no_grad():
            for p, q in zip(model.parameters(), plain.parameters()):
                p.grad.copy_(q.grad / size)
        preconditioner.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> bool:
    """Equal to float32 round-off, relative to the tensor's norm (collectives sum in another order)."""
    return bool((a - b).norm() <= rtol * b.norm() + 1e-8)


def tolerance(kwargs: dict) -> float:
    """close()'s rtol for a job: eigen_adam's step normalises each entry of the gradient in the eigenbasis, so the
    float32 factors' round-off (another summation order) moves eigenvectors of close eigenvalues and with them whole
    entries: 2e-4 of the norm was measured with float64 second-order state (its cases use it), 0.5 with float32."""
    return 1e-3 if kwargs.get('eigen_adam') else 1e-4


def assert_gradients_equal(results: list[dict], expected: list, steps: int = STEPS, label: str = '',
                           rtol: float = 1e-4) -> None:
    """Every rank's gradients at each of the first `steps` steps close to `expected[step]` (one list per step)."""
    for rank, result in enumerate(results):
        for step in range(steps):
            for i, (a, b) in enumerate(zip(result['grads'][step], expected[step])):
                assert close(a, b, rtol), (f'{label}rank {rank}, step {step}, parameter {i}: max diff '
                                           f'{(a - b).abs().max()}')


CASES = [
    (2, dict(strategy='kaisa', grad_worker_fraction=1.0)),
    (2, dict(strategy='kaisa', grad_worker_fraction=0.5, compute_method='inverse')),
    (2, dict(strategy='kaisa', grad_worker_fraction=1.0, symmetry_aware=True, explicit_group=True)),
    (2, dict(strategy='kaisa', grad_worker_fraction=0.25, colocate_factors=False, compute_method='inverse')),
    (2, dict(strategy='spd')),
    (4, dict(strategy='kaisa', grad_worker_fraction=1.0)),
    (4, dict(strategy='kaisa', grad_worker_fraction=0.5)),
    (4, dict(strategy='kaisa', grad_worker_fraction=0.25, compute_method='inverse')),
    (4, dict(strategy='spd', compute_method='inverse')),
    # Adam in the eigenbasis (docs/MATH.md section 8): moments kept by the grad workers, rotated at each refresh (an
    # eps of 1e-4 keeps Adam's quotient of near-zero entries from magnifying the collectives' round-off). Where a
    # factor's eigenvalues are degenerate (8.2: the CNN's head at 4 ranks), any basis there is LAPACK's choice and
    # Adam's step depends on it: those cases run the LM (LM_CASES, DCP_CASES).
    (2, dict(strategy='kaisa', grad_worker_fraction=0.5,
             eigen_adam=True, kl_clip=None, adam_eps=1e-4, inv_dtype='float64')),
    # second_order_lag (docs/MATH.md section 2.8): step 1's update installed and shared at step 2, as in one process.
    (2, dict(strategy='kaisa', grad_worker_fraction=0.5, inv_update_steps=1, second_order_lag=1)),
]


@pytest.mark.parametrize('size,kwargs', CASES, ids=[f'{s}-{"-".join(map(str, k.values()))}' for s, k in CASES])
def test_equals_single_process_reference(size, kwargs, tmp_path):
    results = run_workers(size, {**COMMON, **kwargs}, tmp_path)
    assert results[0]['layers'] == ['module.0', 'module.2', 'module.5'], 'DDP names layers as kfac_pytorch does'
    # Every rank runs the same plan, for the strategy and world asked for.
    assert all(result['plan'] == results[0]['plan'] for result in results), [r['plan'] for r in results]
    system = {'kaisa': 'KAISA', 'spd': 'SPD-KFAC'}[kwargs['strategy']]
    assert results[0]['plan'].startswith(f"step plan: {system} ({kwargs['strategy']}), P={size} "), results[0]['plan']
    assert 'module.2 [' in results[0]['plan'], results[0]['plan']
    # What Python reports of the grid is the one the plan ran (W from its header), by the core's rules.
    workers = int(re.search(r' W=(\d+)', results[0]['plan']).group(1))
    fraction = kwargs.get('grad_worker_fraction', 1.0)
    mem_opt = workers == 1
    assert results[0]['layout'] == {
        'distributed_strategy': 'COMM_OPT' if workers == size else 'MEM_OPT' if mem_opt else 'HYBRID_OPT',
        'grad_worker_fraction': fraction, 'colocate_factors': kwargs.get('colocate_factors', True) or mem_opt}
    forced = 'grad_worker_fraction=1/world_size (MEM_OPT) requires colocate_factors=True; enabling it'
    assert (forced in results[0]['warnings']) == (mem_opt and kwargs.get('colocate_factors') is False), results[0]
    expected = reference(size, {**COMMON, **{k: v for k, v in kwargs.items() if k != 'explicit_group'}})
    assert_gradients_equal(results, expected, rtol=tolerance(kwargs))


# The layer kinds of a transformer (docs/MATH.md section 7): an Embedding (A diagonal), a Conv1D (weight stored
# transposed) and a 40-token head whose G is kept diagonal (diagonal_factor_dim=16), under every strategy.
LM_CASES = [
    (2, dict(strategy='kaisa', grad_worker_fraction=0.5)),
    (2, dict(strategy='spd', compute_method='inverse', symmetry_aware=True)),
    (4, dict(strategy='kaisa', grad_worker_fraction=0.25, colocate_factors=False, compute_method='inverse',
             symmetry_aware=True)),
    (4, dict(strategy='spd')),
    (4, dict(strategy='kaisa', grad_worker_fraction=0.5,
             eigen_adam=True, kl_clip=None, adam_eps=1e-4, inv_dtype='float64')),
    (4, dict(strategy='spd', eigen_adam=True, kl_clip=None, adam_eps=1e-4, inv_dtype='float64')),
]


@pytest.mark.parametrize('size,kwargs', LM_CASES, ids=[f'{s}-{"-".join(map(str, k.values()))}' for s, k in LM_CASES])
def test_transformer_layers_equal_the_single_process_reference(size, kwargs, tmp_path):
    lm = {**COMMON, 'model': 'lm', 'diagonal_factor_dim': 16, 'inv_dtype': 'float64'}
    results = run_workers(size, {**lm, **kwargs}, tmp_path)
    assert results[0]['layers'] == ['module.wte', 'module.c_fc', 'module.head']
    assert 'module.head [a=13, g=40 diagonal]' in results[0]['plan'], results[0]['plan']
    assert 'module.wte [a=40 diagonal, g=8]' in results[0]['plan'], results[0]['plan']
    expected = reference(size, {**lm, 'inv_dtype': torch.float64, **kwargs})
    assert_gradients_equal(results, expected, rtol=tolerance(kwargs))


# FSDP2 (fully_shard on every leaf and the root, a 1-D mesh) and HSDP (2 x 2: replicate x shard): the K-FAC job
# equals the single-process reference, which the same job under DDP equals (test_equals_single_process_reference).
SHARDED_CASES = [
    (2, dict(shard='fsdp', strategy='kaisa', grad_worker_fraction=1.0)),
    (2, dict(shard='fsdp', strategy='kaisa', grad_worker_fraction=0.5, compute_method='inverse')),
    (2, dict(shard='fsdp', strategy='spd', model='lm', diagonal_factor_dim=16)),
    (4, dict(shard='fsdp', strategy='kaisa', grad_worker_fraction=0.25, model='lm', diagonal_factor_dim=16)),
    (4, dict(shard='hsdp', strategy='kaisa', grad_worker_fraction=0.5)),
    (2, dict(shard='fsdp', shard_after=True, strategy='kaisa', grad_worker_fraction=1.0)),
    # Owner placement: each layer's owner alone holds its K-FAC state, gathers and scatters the gradient's rows.
    (2, dict(shard='fsdp', strategy='kaisa', sharded_placement='owner')),
    (4, dict(shard='fsdp', strategy='kaisa', sharded_placement='owner', model='lm', diagonal_factor_dim=16)),
    (4, dict(shard='hsdp', strategy='kaisa', sharded_placement='owner', compute_method='inverse')),
    (2, dict(shard='fsdp', strategy='kaisa', sharded_placement='owner',
             eigen_adam=True, kl_clip=None, adam_eps=1e-4, inv_dtype='float64')),
    (4, dict(shard='fsdp', strategy='kaisa', sharded_placement='owner', inv_update_steps=1, second_order_lag=1)),
    # The factors summed into their owners (rows of 3 or more), at step() and from the capture hooks under HSDP 2 x 3.
    (4, dict(shard='fsdp', strategy='kaisa', sharded_placement='owner', update_factors_in_hook=False)),
    (6, dict(shard='hsdp3', strategy='kaisa', sharded_placement='owner', model='lm', diagonal_factor_dim=16)),
]


@pytest.mark.parametrize('placement', ['replicated', 'owner'])
def test_a_sharded_weight_frozen_mid_training_stays_frozen(placement, tmp_path):
    """requires_grad_(False) on an FSDP2 layer's weight at step 2, its bias trained, gradients zeroed in place: the
    core sees the layer through stand-ins, whose requires_grad was copied once, so the frozen weight was
    preconditioned with its bias and moved (7e-4 over 3 steps); the stand-ins follow it now, and the layer keeps its
    plain gradients (unused_layer_policy='skip'), as in one process."""
    kwargs = {**COMMON, 'shard': 'fsdp', 'strategy': 'kaisa', 'sharded_placement': placement,
              'unused_layer_policy': 'skip', 'freeze_weight_at': {'step': 2, 'layer': 0}, 'steps': 5}
    if placement == 'replicated':
        kwargs['grad_worker_fraction'] = 1.0
    results = run_workers(2, kwargs, tmp_path)
    for result in results:
        frozen = [torch.as_tensor(p) for p in (result['params'][2][3], result['params'][-1][3])]  # the Linear's
        assert torch.equal(*frozen), (frozen[0] - frozen[1]).abs().max()
        bias = [torch.as_tensor(p) for p in (result['params'][2][4], result['params'][-1][4])]
        assert not torch.equal(*bias)  # it trained on


@pytest.mark.parametrize('size,kwargs', SHARDED_CASES,
                         ids=[f'{s}-{"-".join(map(str, k.values()))}' for s, k in SHARDED_CASES])
def test_sharded_models_equal_the_single_process_reference(size, kwargs, tmp_path):
    results = run_workers(size, {**COMMON, **kwargs}, tmp_path)
    lm = kwargs.get('model') == 'lm'
    assert results[0]['layers'] == (['wte', 'c_fc', 'head'] if lm else ['0', '2', '5']), results[0]['layers']
    assert all(result['plan'] == results[0]['plan'] for result in results)
    expected = reference(size, {**COMMON, **{k: v for k, v in kwargs.items()
                                             if k not in ('shard', 'shard_after', 'sharded_placement')}})
    assert_gradients_equal(results, expected, rtol=tolerance(kwargs))


@pytest.mark.parametrize('size,shard', [(2, 'fsdp'), (4, 'fsdp'), (4, 'hsdp')])
def test_owner_placement_keeps_each_layers_state_with_its_owners(size, shard, tmp_path):
    """Owner placement holds each layer's factors and second-order state on its owner in each shard group (one
    rank of P under FSDP, one per replica under HSDP), and nowhere else: the ranks' K-FAC state adds up to the
    single-process state times the replicas, where the replicated placement holds the whole state on every rank."""
    kwargs = {**COMMON, 'strategy': 'kaisa', 'model': 'lm', 'diagonal_factor_dim': 16, 'shard': shard}
    (tmp_path / 'owner').mkdir(), (tmp_path / 'replicated').mkdir()
    owner = run_workers(size, {**kwargs, 'sharded_placement': 'owner'}, tmp_path / 'owner')
    replicated = run_workers(size, {**kwargs, 'grad_worker_fraction': 1.0}, tmp_path / 'replicated')
    replicas = 1 if shard == 'fsdp' else size // 2
    assert 'sharded layers (3 of 3): owner' in owner[0]['plan'], owner[0]['plan']
    assert 'sharded layers (3 of 3): replicated' in replicated[0]['plan'], replicated[0]['plan']
    state = lambda m: m['total'] - m['a_batch'] - m['g_batch']  # what is held between steps
    whole = state(replicated[0]['memory'])
    assert whole > 0 and all(state(r['memory']) == whole for r in replicated)
    assert sum(state(r['memory']) for r in owner) == replicas * whole, [r['memory'] for r in owner]
    assert max(state(r['memory']) for r in owner) < whole


@pytest.mark.parametrize('size,shard,placement', [(2, 'fsdp', 'replicated'), (2, 'fsdp', 'owner'),
                                                  (4, 'hsdp', 'replicated'), (4, 'hsdp', 'owner')])
def test_sharded_gradients_move_inside_the_core_step_as_the_plan_predicts(size, shard, placement, tmp_path):
    """The distributors' gathers and scatters run inside the core's step (Distributor): their bytes are the
    communicator's 'gradients' traffic, each step what the plan predicts for each rank (replicated: the rows it
    lacks, all-gathered over its shard group, HSDP's 2 ranks; owner: the rows to the owner and back), their calls
    one collective per sharded tensor each way, and their time communication."""
    kwargs = {**COMMON, 'strategy': 'kaisa', 'model': 'lm', 'diagonal_factor_dim': 16, 'shard': shard,
              'sharded_placement': placement}
    if placement == 'replicated':
        kwargs['grad_worker_fraction'] = 1.0  # no V broadcast: the gathers are the layer's only gradient traffic
    results = run_workers(size, kwargs, tmp_path)
    tensors = 5  # wte's weight, c_fc's and head's weight and bias: every one sharded
    for rank, result in enumerate(results):
        calls, moved = result['traffic']['gradients']
        assert moved == STEPS * result['predicted_gradient_bytes'][rank] > 0, (rank, moved, result['plan'])
        assert calls == STEPS * tensors * (1 if placement == 'replicated' else 2), (rank, calls)
        assert result['times']['communication'] > 0


@pytest.mark.parametrize('size,shard,in_hooks', [(4, 'fsdp', True), (4, 'fsdp', False), (6, 'hsdp3', True),
                                                 (4, 'hsdp', True)])
def test_owner_placement_sums_the_factors_into_their_owners_as_the_plan_predicts(size, shard, in_hooks, tmp_path):
    """Under owner placement only a layer's owners keep its factors, so where a row (shard group) has 3 ranks or
    more the ranks' batch means are summed into the layer's owner in each row (a reduce: N bytes per rank on a ring,
    an allreduce's 2 (P - 1) / P N), then among the owners of its column (HSDP's replicas, W = 2), and divided by the
    world size, in place of an average onto every rank. The 'factors' traffic is what the plan predicts for each rank
    (under HSDP an owner's column sums come on top, which an allreduce over the world did not have), from the capture
    hooks and at step() alike, and the plan says so; rows of 2 keep the allreduce. That the factors are the world's
    mean: test_sharded_models_equal_the_single_process_reference."""
    kwargs = {**COMMON, 'strategy': 'kaisa', 'model': 'lm', 'diagonal_factor_dim': 16, 'shard': shard,
              'sharded_placement': 'owner', 'update_factors_in_hook': in_hooks}
    results = run_workers(size, kwargs, tmp_path)
    for rank, result in enumerate(results):
        moved = result['traffic']['factors'][1]
        assert moved == STEPS * result['predicted_factor_bytes'][rank] > 0, (rank, moved, result['plan'])
    reduces = shard != 'hsdp'
    assert ("the row's factors are summed into it (a reduce" in results[0]['plan']) == reduces, results[0]['plan']
    assert ('factors summed into their owners' in results[0]['plan']) == (reduces and in_hooks), results[0]['plan']
    if shard == 'hsdp3':
        assert 'then an allreduce among the layer\'s 2 owners' in results[0]['plan'], results[0]['plan']


@pytest.mark.parametrize('strategy', [dict(strategy='dp'), dict(strategy='kaisa', grad_worker_fraction=0.5)])
def test_eigen_adam_keeps_each_layers_moments_where_it_is_preconditioned(strategy, tmp_path):
    """eigen_adam's moments are held by the one rank that preconditions each layer (DP-KFAC's owner, KAISA's grad
    worker at W = 1), counted by memory_usage() there, and every rank steps on the V that rank broadcasts."""
    kwargs = {**COMMON, **strategy, 'model': 'lm', 'diagonal_factor_dim': 16, 'eigen_adam': True, 'kl_clip': None}
    results = run_workers(2, kwargs, tmp_path)
    holders = {}
    for rank, result in enumerate(results):
        held = result['state']['dkfac']['held']
        for name, flags in held.items():
            if flags.get('exp_avg'):
                holders.setdefault(name, []).append(rank)
    assert sorted(holders) == sorted(results[0]['layers']) and all(len(r) == 1 for r in holders.values()), holders
    sizes = {name: results[ranks[0]]['state']['dkfac']['second_order'][name]['exp_avg']
             for name, ranks in holders.items()}
    expected = [sum(2 * t.numel() * t.element_size() + 4 for name, t in sizes.items() if holders[name] == [rank])
                for rank in range(2)]
    assert [r['memory'].get('adam_moments', 0) for r in results] == expected
    for s in range(STEPS):
        assert all(torch.equal(a, b) for a, b in zip(results[1]['grads'][s], results[0]['grads'][s]))


def test_dp_kfac_owner_placement_equals_dp_kfac_under_ddp(tmp_path):
    """DP-KFAC's owner builds a layer's factors from its own batch; under FSDP2 with owner placement it also
    gathers the gradient's rows and scatters them back instead of broadcasting V: the same gradients as DDP."""
    kwargs = {**COMMON, 'strategy': 'dp', 'model': 'lm', 'diagonal_factor_dim': 16}
    (tmp_path / 'ddp').mkdir(), (tmp_path / 'fsdp').mkdir()
    ddp = run_workers(2, kwargs, tmp_path / 'ddp')
    sharded = run_workers(2, {**kwargs, 'shard': 'fsdp', 'sharded_placement': 'owner'}, tmp_path / 'fsdp')
    assert 'sharded layers (3 of 3): owner' in sharded[0]['plan']
    assert_gradients_equal(sharded, ddp[0]['grads'])


def test_fsdp2_mixed_precision_keeps_float32_factors(tmp_path):
    """Under FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16) the layers compute in bfloat16, and the factors
    are still float32 (the parameters' dtype), built from those bfloat16 values; the preconditioned gradients stay
    near the float32 job's, as far as bfloat16's forward allows. That the factors are the float32 products of the
    bfloat16 values, not bfloat16 sums, is the C++ FactorCapture.LowerPrecisionInputsOfAFloat32LayerBuildFloat32Factors."""
    kwargs = {**COMMON, 'shard': 'fsdp', 'strategy': 'kaisa', 'grad_worker_fraction': 0.5}
    mixed = run_workers(2, {**kwargs, 'param_dtype': 'bfloat16'}, tmp_path)
    for result in mixed:
        for name, layer in result['state']['layers'].items():
            for side, factor in layer.items():
                assert factor.dtype == torch.float32 and torch.isfinite(factor).all(), (name, side, factor.dtype)
    # bfloat16's forward moves each gradient about 0.5% (measured: 0.3-0.8% at steps 0-2); K-FAC's step 3 (after
    # the inverse step 2 and its KL clip) took that to 7.5%.
    expected = reference(2, {k: v for k, v in kwargs.items() if k != 'shard'})
    for step in range(STEPS):
        for i, (a, b) in enumerate(zip(mixed[0]['grads'][step], expected[step])):
            bound = 2e-2 if step < 3 else 0.15
            assert (a - b).norm() <= bound * b.norm(), f'step {step}, parameter {i}: {(a - b).norm() / b.norm()}'


LONG_CASES = [
    (4, dict(shard='fsdp', strategy='kaisa', sharded_placement='owner'), dict(strategy='kaisa', grad_worker_fraction=0.0)),
    (4, dict(shard='hsdp', strategy='kaisa', sharded_placement='owner'), dict(strategy='kaisa', grad_worker_fraction=0.5)),
    (2, dict(shard='fsdp', strategy='spd'), dict(strategy='spd')),
    (2, dict(shard='fsdp', strategy='dp', sharded_placement='owner'), dict(strategy='dp')),
    # Every strategy at 4 ranks, replicated: SPD-KFAC on HSDP 2 x 2, DP-KFAC on FSDP and HSDP.
    (4, dict(shard='hsdp', strategy='spd'), dict(strategy='spd')),
    (4, dict(shard='fsdp', strategy='dp'), dict(strategy='dp')),
    (4, dict(shard='hsdp', strategy='dp'), dict(strategy='dp')),
]


@pytest.mark.parametrize('size,sharded,ddp', LONG_CASES,
                         ids=[f'{s}-{"-".join(map(str, k.values()))}' for s, k, _ in LONG_CASES])
def test_sharded_jobs_equal_ddp_over_20_steps(size, sharded, ddp, tmp_path):
    """Over 20 steps (factor and inverse updates every other step, KL clipping on), a sharded job stays equal to
    the same job under DDP with the same global batch, to float32 round-off."""
    kwargs = {**COMMON, 'steps': 20, 'model': 'cnn'}
    (tmp_path / 'ddp').mkdir(), (tmp_path / 'sharded').mkdir()
    reference_run = run_workers(size, {**kwargs, **ddp}, tmp_path / 'ddp')
    sharded_run = run_workers(size, {**kwargs, **sharded}, tmp_path / 'sharded')
    assert len(sharded_run[0]['grads']) == 20
    assert_gradients_equal(sharded_run, reference_run[0]['grads'], steps=20)


@pytest.mark.parametrize('placement', ['replicated', 'owner'])
def test_a_compiled_fsdp2_model_equals_the_eager_one(placement, tmp_path):
    """torch.compile of a model sharded with FSDP2 (the capture hooks included: on factor steps each K-FAC layer's
    hook is a graph break, tests/python/test_compile.py) trains with K-FAC to the eager sharded model's gradients."""
    kwargs = {**COMMON, 'strategy': 'kaisa', 'shard': 'fsdp', 'sharded_placement': placement,
              **({'grad_worker_fraction': 0.5} if placement == 'replicated' else {})}
    (tmp_path / 'eager').mkdir(), (tmp_path / 'compiled').mkdir()
    eager = run_workers(2, kwargs, tmp_path / 'eager')
    compiled = run_workers(2, {**kwargs, 'compile': 'aot_eager'}, tmp_path / 'compiled')
    assert all(result['compiled_graphs'] > 0 for result in compiled), [r['compiled_graphs'] for r in compiled]
    for rank, result in enumerate(compiled):
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(result['grads'][step], eager[rank]['grads'][step])):
                assert close(a, b), f'rank {rank}, step {step}, parameter {i}: max diff {(a - b).abs().max()}'


@pytest.mark.parametrize('shard', ['fsdp', 'hsdp'])
def test_fsdp2_gradient_accumulation_equals_ddp_no_sync(shard, tmp_path):
    """Two micro-batches per step, gradients reduced after the last only: FSDP2 with
    set_requires_gradient_sync(False) before it equals the same job under DDP with no_sync()."""
    kwargs = {**COMMON, 'strategy': 'kaisa', 'grad_worker_fraction': 0.5, 'accumulation_steps': 2}
    (tmp_path / 'ddp').mkdir(), (tmp_path / 'fsdp').mkdir()
    ddp = run_workers(4, kwargs, tmp_path / 'ddp')
    sharded = run_workers(4, {**kwargs, 'shard': shard}, tmp_path / 'fsdp')
    assert_gradients_equal(sharded, ddp[0]['grads'])


# Per model: each K-FAC layer's parameters, by index in model.parameters() (lm: the LayerNorm's 3 and 4 are plain).
PARAMS_OF_LAYER = {'cnn': [[0, 1], [2], [3, 4]], 'lm': [[0], [1, 2], [5, 6]]}


@pytest.mark.parametrize('size,model,shard', [(2, 'cnn', None), (4, 'cnn', None), (2, 'lm', None), (2, 'cnn', 'fsdp')])
def test_dp_kfac_equals_the_owners_local_factors(size, model, shard, tmp_path):
    # No clipping: layers are independent, each checked on its own. No running average either (decay 0):
    # each step's factors are that step's shard alone, so shards differ clearly. Such rank-deficient
    # factors make eigenvectors of the null space arbitrary, which the inverse method does not see.
    kwargs = {**COMMON, 'kl_clip': 0.0, 'factor_decay': 0.0, 'compute_method': 'inverse', 'inv_update_steps': 1,
              'model': model, 'diagonal_factor_dim': 16}
    results = run_workers(size, {**kwargs, 'strategy': 'dp', **({'shard': shard} if shard else {})}, tmp_path)
    # Each layer's factors come from its owner's shard alone; the reference for shard r follows the
    # distributed run's parameters, so that a layer matches it at every step exactly when r owns the layer.
    references = [reference(size, kwargs, factor_shard=r, teacher=results[0]['params']) for r in range(size)]
    params_of_layer = PARAMS_OF_LAYER[model]
    for rank, result in enumerate(results):
        for layer, params in enumerate(params_of_layer):
            owners = [r for r in range(size)
                      if all(close(result['grads'][s][i], references[r][s][i]) for s in range(STEPS) for i in params)]
            assert len(owners) == 1, f'rank {rank}: layer {layer} matches shards {owners}, not exactly its owner\'s'
    # Everyone agrees on V (the owner broadcasts it).
    for result in results[1:]:
        for s in range(STEPS):
            assert all(torch.equal(a, b) for a, b in zip(result['grads'][s], results[0]['grads'][s]))


@pytest.mark.parametrize('source', ['own', 'rank0'])
def test_state_dict_resume_under_torch_distributed(source, tmp_path):
    """Each rank reloading its own state dict continues bit for bit; all reloading rank 0's recompute the
    second-order state together (a collective: no rank may skip it) and continue."""
    kwargs = {**COMMON, 'strategy': 'kaisa', 'grad_worker_fraction': 0.5, 'inv_update_steps': 3, 'resume': source}
    results = run_workers(2, kwargs, tmp_path)
    for rank, result in enumerate(results):
        assert result['resumed_steps'] == STEPS + 1
        for a, b in zip(result['resumed'], result['continued']):
            if source == 'own':
                assert torch.equal(a, b), f'rank {rank}: exact resume differs by {(a - b).abs().max()}'
            else:
                assert torch.isfinite(a).all()


@pytest.mark.parametrize('model', ['cnn', 'lm'])
def test_strategy_auto_picks_on_every_rank_alike_and_trains_as_its_pick(model, tmp_path):
    """strategy='auto' measures this machine at the first step, every rank runs rank 0's pick, and the
    gradients are that strategy's (whichever this machine's rates pick): KAISA's and SPD-KFAC's equal the
    single-process reference, DP-KFAC's a DP-KFAC run's."""
    kwargs = {**COMMON, 'kl_clip': 0.0, 'compute_method': 'inverse', 'inv_update_steps': 1, 'model': model,
              'diagonal_factor_dim': 16}
    results = run_workers(2, {**kwargs, 'strategy': 'auto'}, tmp_path)
    choice = results[0]['choice']
    assert choice.startswith('strategy auto: 6 candidates'), choice
    assert 'rates measured now on 2 ranks' in choice, choice
    assert all(r['choice'] == choice and r['plan'] == results[0]['plan'] for r in results)
    picked = choice.split('picked ')[1].split(':')[0]
    system = picked.split()[0]
    assert results[0]['plan'].startswith('step plan: ' + {'kaisa': 'KAISA', 'spd': 'SPD-KFAC', 'dp': 'DP-KFAC'}[system]
                                         + f' ({system}), P=2 '), (picked, results[0]['plan'])
    if system == 'dp':
        expected = run_workers(2, {**kwargs, 'strategy': 'dp'}, tmp_path)[0]['grads']
    else:
        expected = reference(2, kwargs)
    assert_gradients_equal(results, expected, label=f'{picked}: ')


class _Wrapped(torch.nn.Module):
    """The model under the name DDP gives it ('module'), so that layer names match a DDP job's."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize('strategy', ['dp', 'kaisa'])
def test_gathered_state_dict_resumes_exactly_on_another_world_size(strategy, tmp_path):
    """state_dict(gathered=True), called on every rank of a 2-rank job, is the same on both and holds every
    layer's whole state; one process loads it exactly. A DP-KFAC rank's own state_dict holds only its layers'
    factors, and loading it elsewhere is refused with the way out."""
    kwargs = {**COMMON, 'compute_method': 'inverse', 'strategy': strategy}
    if strategy == 'kaisa':
        kwargs['grad_worker_fraction'] = 0.5
    results = run_workers(2, {**kwargs, 'save_gathered': True}, tmp_path)
    gathered = [r['gathered'] for r in results]
    names = list(gathered[0]['layers'])
    for rank in (0, 1):
        assert gathered[rank]['dkfac']['gathered'] and gathered[rank]['dkfac']['strategy'] == strategy
        for name in names:
            for key in ('A', 'G'):
                assert torch.equal(gathered[rank]['layers'][name][key], gathered[0]['layers'][name][key])
            second = gathered[rank]['dkfac']['second_order'][name]
            assert sorted(second) == ['a_inverse', 'g_inverse'], (rank, name, sorted(second))
            for key, tensor in second.items():
                assert torch.equal(tensor, gathered[0]['dkfac']['second_order'][name][key])
    single = {k: v for k, v in kwargs.items() if k not in ('strategy', 'grad_worker_fraction')}
    preconditioner = dkfac.KFACPreconditioner(_Wrapped(scenarios.make_model('cnn')), **single)
    preconditioner.load_state_dict(gathered[0])
    assert preconditioner.steps == STEPS
    for name, state in zip(names, preconditioner._core.layer_states()):
        expected = {'a_factor': gathered[0]['layers'][name]['A'], 'g_factor': gathered[0]['layers'][name]['G'],
                    **gathered[0]['dkfac']['second_order'][name]}
        assert sorted(state) == sorted(expected), name
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (name, key)
    own = results[0]['own']
    if strategy == 'dp':
        assert any('A' not in own['layers'][name] for name in names), 'rank 0 owns every layer?'
        with pytest.raises(ValueError, match=r"holds the factors of that rank's own layers only .* "
                                             r'save state_dict\(gathered=True\), called on every rank'):
            dkfac.KFACPreconditioner(_Wrapped(scenarios.make_model('cnn')), **single).load_state_dict(own)
    else:  # every rank holds every factor: rank 0's own dict resumes on one process (second order recomputed)
        twin = dkfac.KFACPreconditioner(_Wrapped(scenarios.make_model('cnn')), **single)
        twin.load_state_dict(own)
        for name, state in zip(names, twin._core.layer_states()):
            assert torch.equal(state['a_factor'], gathered[0]['layers'][name]['A'])
            assert 'a_inverse' in state and 'g_inverse' in state


@pytest.mark.parametrize('resume_as', [dict(strategy='kaisa', grad_worker_fraction=0.5), dict(strategy='auto'),
                                       dict(strategy='spd', compute_method='eigen')])
def test_each_ranks_own_dp_kfac_state_resumes_under_another_plan_as_the_gathered_one(resume_as, tmp_path):
    """A DP-KFAC rank's own state_dict() holds its own layers' factors only. Loaded on its own rank by a job of
    another plan (another strategy, or strategy auto, whose first plan keeps every factor everywhere), each part a
    rank keeps but was not handed comes from the rank that holds it: the ranks' own states together load as the
    gathered state does, bit for bit, and train alike. (It was refused, naming state_dict(gathered=True).)"""
    kwargs = {**COMMON, 'compute_method': 'inverse', 'strategy': 'dp', 'resume_as': resume_as}
    results = run_workers(2, kwargs, tmp_path)
    for rank, result in enumerate(results):
        own, gathered = result['resumed_as']['own'], result['resumed_as']['gathered']
        # auto and SPD-KFAC measure at their first steps (the pick, the decomposition threshold)
        assert resume_as['strategy'] != 'kaisa' or own['plan'] == gathered['plan'], rank
        assert len(own['loaded']) == len(gathered['loaded'])
        for layer, (a, b) in enumerate(zip(own['loaded'], gathered['loaded'])):
            assert sorted(a) == sorted(b), (rank, layer, sorted(a), sorted(b))
            assert 'a_factor' in a and 'g_factor' in a, (rank, layer, sorted(a))
            for key in a:
                assert torch.equal(a[key], b[key]), (rank, layer, key)
        if resume_as['strategy'] != 'auto':  # auto measures at that step, and may pick others for the twins
            for a, b in zip(own['grads'], gathered['grads']):
                assert torch.equal(a, b), rank


@pytest.mark.parametrize('gathered', [True, False], ids=['gathered', 'own'])
def test_an_optimizers_state_dict_saved_by_rank_0_for_all_resumes_with_gathered_state_dict(gathered, tmp_path):
    """Lightning and accelerate under DDP call opt.state_dict() on every rank and save rank 0's for all. Under DP-KFAC
    rank 0's own K-FAC state lacks the other ranks' layers: loaded on every rank it is refused, naming the way out;
    with dkfac.optim.KFAC(..., gathered_state_dict=True) it holds every layer's state, and the job resumes from it
    bit for bit."""
    results = workers.run_workers('optim_worker.py', 2, {'gathered_state_dict': gathered}, tmp_path)
    for rank, result in enumerate(results):
        if gathered:
            assert result['error'] == '', result['error']
            assert all(torch.equal(a, b) for a, b in zip(result['continued'], result['resumed'])), rank
    if not gathered:
        # Refused on every rank, each naming the way out (a rank whose own dict passed its checks names the rank that
        # refused, and why), not waiting in the restore's collective for that rank until it is named lost.
        named = 'build the optimizer with gathered_state_dict=True'
        assert all(named in result['error'] for result in results), [result['error'] for result in results]


def test_ranks_own_states_of_different_steps_are_refused_on_every_rank_naming_the_steps(tmp_path):
    """Each rank's own DP-KFAC state resumes as one under another plan only if they are of one save: rank 1's one
    step older is refused on both ranks, naming each rank's step count."""
    kwargs = {**COMMON, 'compute_method': 'inverse', 'strategy': 'dp',
              'resume_as': dict(strategy='kaisa', grad_worker_fraction=0.5, stale=True)}
    results = run_workers(2, kwargs, tmp_path)
    for result in results:
        said = result['resumed_as']['own']['refused']
        assert f'rank 0: {STEPS}, rank 1: {STEPS - 1}' in said and 'saved at one step' in said, said
        assert 'grads' in result['resumed_as']['gathered']


def test_a_state_dict_refused_by_one_ranks_checks_is_refused_on_every_rank_naming_it(tmp_path):
    """load_state_dict is collective (the restore that follows its checks): a dict that one rank's own checks refuse
    (rank 1's lacks a layer's entry) stops every rank at once, each naming rank 1 and its reason, where rank 0 used to
    wait in the restore until rank 1 was named lost; nothing is loaded, and the job goes on: the gathered state then
    loads and steps on both ranks."""
    kwargs = {**COMMON, 'strategy': 'kaisa', 'grad_worker_fraction': 0.5,
              'resume_as': dict(strategy='kaisa', grad_worker_fraction=0.5, broken_on=1)}
    results = run_workers(2, kwargs, tmp_path)
    refusals = [result['resumed_as']['own']['refused'] for result in results]
    assert refusals[1].startswith("state_dict holds no entry for K-FAC layer 'module.0'"), refusals[1]
    assert refusals[0] == ("state_dict: the state dict given to rank 1 was refused there, so nothing was loaded on "
                           f'any rank (load_state_dict is collective): rank 1: ValueError: {refusals[1]}'), refusals
    for result in results:
        assert 'grads' in result['resumed_as']['gathered']


# Checkpoints through torch.distributed.checkpoint (DCP): saved after step 1 with the second-order state of step 0
# (inverse steps 0 and 3), loaded into a fresh job of another world size or strategy that trains steps 2 and 3.
# Recomputing the second-order state from step 1's factors would change step 2, so equality shows it was loaded.
DCP_CASES = [
    (4, 2, dict(strategy='kaisa', grad_worker_fraction=0.5), {}),
    (2, 4, dict(strategy='kaisa', grad_worker_fraction=1.0, model='lm', diagonal_factor_dim=16),
     dict(grad_worker_fraction=0.25)),
    (4, 2, dict(strategy='spd', compute_method='inverse'), dict(strategy='kaisa', grad_worker_fraction=0.5)),
    (4, 2, dict(shard='fsdp', strategy='kaisa', grad_worker_fraction=0.5), {}),
    (4, 2, dict(shard='hsdp', strategy='kaisa', grad_worker_fraction=0.25), dict(shard='fsdp')),
    # Owner placement: each owner writes its layers; the new job's owners read theirs, or every rank all of it.
    (4, 2, dict(shard='fsdp', strategy='kaisa', sharded_placement='owner'), {}),
    (4, 2, dict(shard='hsdp', strategy='kaisa', sharded_placement='owner'),
     dict(shard='fsdp', sharded_placement='replicated', grad_worker_fraction=1.0)),
    # Adam's moments: written by the grad workers that hold them, read by the new job's.
    (4, 2, dict(strategy='kaisa', grad_worker_fraction=0.5, model='lm', diagonal_factor_dim=16,
                eigen_adam=True, kl_clip=None, adam_eps=1e-4, inv_dtype='float64'), dict(grad_worker_fraction=1.0)),
]


@pytest.mark.parametrize('saved,loaded,kwargs,changed', DCP_CASES,
                         ids=[f'{s}to{l}-{"-".join(map(str, k.values()))}' for s, l, k, _ in DCP_CASES])
def test_dcp_checkpoint_resumes_on_another_world_size(saved, loaded, kwargs, changed, tmp_path):
    """dcp.save({'model', 'optim', 'kfac': preconditioner}) writes each K-FAC entry once (no rank gathers), and
    dcp.load into a job of another world size (and placement) continues the uninterrupted run exactly."""
    kwargs = {**COMMON, 'inv_update_steps': 3, **kwargs}
    checkpoint = tmp_path / 'checkpoint'
    (tmp_path / 'saved').mkdir(), (tmp_path / 'loaded').mkdir()
    first = run_workers(saved, {**kwargs, 'dcp_save': {'dir': str(checkpoint), 'after': 1}}, tmp_path / 'saved')
    second = run_workers(loaded, {**kwargs, **changed, 'dcp_load': {'dir': str(checkpoint), 'at': 2}},
                         tmp_path / 'loaded')
    # Each entry of the whole state written once, by the ranks that hold it, not gathered to one writer.
    gathered = first[0]['saved_gathered']
    entries = {f'kfac.layers.{name}.{side}' for name, layer in gathered['layers'].items() for side in layer}
    entries |= {f'kfac.dkfac.second_order.{name}.{key}' for name, layer in gathered['dkfac']['second_order'].items()
                for key in layer}
    stored = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    files = {index.fqn: info.relative_path for index, info in stored.items() if index.fqn.startswith('kfac.')
             and not index.fqn.startswith('kfac.dkfac.held.')}
    tensors = {fqn: file for fqn, file in files.items() if fqn.startswith(('kfac.layers.', 'kfac.dkfac.second_order.'))}
    assert set(tensors) == entries, sorted(set(tensors) ^ entries)
    assert len(set(tensors.values())) > 1, f'one rank wrote every K-FAC entry: {set(tensors.values())}'
    # Every rank of the new job holds exactly what it needs, equal to the saved job's whole state.
    names = list(gathered['layers'])
    for rank, result in enumerate(second):
        for name, state in zip(names, result['loaded']):
            expected = {'a_factor': gathered['layers'][name]['A'], 'g_factor': gathered['layers'][name]['G'],
                        **gathered['dkfac']['second_order'][name]}
            for key, tensor in state.items():
                assert torch.equal(tensor, expected[key]), (rank, name, key)
    # Each shard's factors scale with its size (kfac_pytorch's factors of a mean loss), so the run continues
    # as one whose shards changed at step 2: the single-process reference resized there.
    plain = {k: v for k, v in {**kwargs, **changed}.items()
             if k not in ('shard', 'dcp_save', 'dcp_load', 'sharded_placement')}
    expected = reference(saved, plain, resize=(2, loaded))[2:]
    for step, (got, want) in enumerate(zip(first[0]['grads'][:3], reference(saved, plain)), start=0):
        assert all(close(a, b, tolerance(kwargs)) for a, b in zip(got, want)), f'saved job, step {step}'
    for rank, result in enumerate(second):
        assert len(result['grads']) == len(expected)
        for step, (got, want) in enumerate(zip(result['grads'], expected), start=2):
            for i, (a, b) in enumerate(zip(got, want)):
                assert close(a, b, tolerance(kwargs)), (f'rank {rank}, step {step}, parameter {i}: max diff '
                                                        f'{(a - b).abs().max()}')


def test_dcp_checkpoint_of_dp_kfac_gives_each_new_owner_its_layers(tmp_path):
    """DP-KFAC: each rank writes only the layers it owns; a job on another world size has new owners, each of
    which reads its layers' factors and second-order state, whoever wrote them. (Its trajectory differs from the
    uninterrupted run from there on: each owner builds factors from its own shard, and the shards changed.)"""
    kwargs = {**COMMON, 'inv_update_steps': 3, 'strategy': 'dp'}
    checkpoint = tmp_path / 'checkpoint'
    (tmp_path / 'saved').mkdir(), (tmp_path / 'loaded').mkdir()
    first = run_workers(4, {**kwargs, 'dcp_save': {'dir': str(checkpoint), 'after': 1}}, tmp_path / 'saved')
    own = [set(name for name, layer in r['state']['layers'].items() if 'A' in layer) for r in first]
    assert sorted(len(o) for o in own) == [0, 1, 1, 1] and len(set.union(*own)) == 3, own
    second = run_workers(2, {**kwargs, 'dcp_load': {'dir': str(checkpoint), 'at': 2}}, tmp_path / 'loaded')
    gathered = first[0]['saved_gathered']
    names = list(gathered['layers'])
    held = [0] * len(names)
    for result in second:
        for i, (name, state) in enumerate(zip(names, result['loaded'])):
            held[i] += 'a_factor' in state
            for key, tensor in state.items():
                expected = {'a_factor': gathered['layers'][name]['A'], 'g_factor': gathered['layers'][name]['G'],
                            **gathered['dkfac']['second_order'][name]}[key]
                assert torch.equal(tensor, expected), (name, key)
    assert held == [1] * len(names), held
    for result in second:
        assert all(torch.isfinite(g).all() for grads in result['grads'] for g in grads)


@pytest.mark.parametrize('per_rank,refused,named', [
    # Constant options are compared when the preconditioner is built (exit 3)...
    ({'1': {'strategy': 'spd'}}, 3, "rank 1 has 'strategy=spd' where rank 0 has 'strategy=kaisa'"),
    ({'0': {'grad_worker_fraction': 0.5}}, 3,
     "rank 1 has 'grad_worker_fraction=1' where rank 0 has 'grad_worker_fraction=0.5'"),
    # ... hyper-parameters, which Python passes as schedules (so that assigning preconditioner.damping works), by
    # their values at the start of each step (exit 4), before any collective that they decide.
    ({'1': {'damping': 0.01}}, 4, 'rank 1 has damping=0.01 where rank 0 has damping=0.003'),
    ({'1': {'kl_clip': 0.01}}, 4, 'rank 1 has kl_clip=0.01 where rank 0 has kl_clip=0.001'),
    ({'1': {'factor_update_steps': 2}}, 4, 'rank 1 has factor_update_steps=2 where rank 0 has factor_update_steps=1'),
])
def test_ranks_that_differ_refuse_within_seconds_naming_the_difference(tmp_path, per_rank, refused, named):
    """Under DDP, ranks whose options differed used to train on with different parameters, or hang for torch's
    30-minute timeout when the difference changed the collectives: now every rank refuses, naming it."""
    start = time.monotonic()
    procs = start_workers(2, dict(COMMON, per_rank=per_rank), tmp_path)
    outputs = outputs_of(procs, 60)
    elapsed = time.monotonic() - start
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == refused, f'rank {rank} exit {proc.returncode}:\n{out}'
        assert named in out, out
        assert ('the ranks built their preconditioners differently' if refused == 3
                else "the ranks' hyper-parameters differ at K-FAC step 0") in out, out
    assert elapsed < 30, f'took {elapsed:.1f} s'


def test_a_layer_one_rank_cannot_use_stops_every_rank_at_that_step(tmp_path):
    """Under the default unused_layer_policy a layer that one rank did not run (a mixture of experts' expert without
    tokens there, a block it skipped) was refused on that rank alone, and the others waited in the step's factor
    allreduce until its process went (90 s measured, the preconditioner's timeout at most): every rank stops at
    that step now, the others naming the rank and the layer."""
    start = time.monotonic()
    procs = start_workers(2, dict(COMMON, skip_at={'0': [2]}), tmp_path)
    outputs = outputs_of(procs, 60)
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 4, f'rank {rank} exit {proc.returncode}:\n{out}'
        assert 'refused at step 2' in out, out
    assert "it did not run on this rank and its gradient is the other ranks'" in outputs[0], outputs[0]
    assert "rank 0 cannot use K-FAC layer 'module.2.conv' (Conv2d) at step 2" in outputs[1], outputs[1]
    assert time.monotonic() - start < 30


@pytest.mark.parametrize('per_rank,named', [
    ({'1': {'strategy': 'dp'}}, "rank 1 has 'strategy=dp' where rank 0 has 'strategy=kaisa'"),
    ({'1': {'damping': 0.01}}, 'rank 1 has damping=0.01 where rank 0 has damping=0.003'),
])
def test_ranks_that_differ_under_torchrun_refuse_within_seconds(tmp_path, per_rank, named):
    """The same refusals with the job launched as users launch it: torchrun (its c10d rendezvous, its agent)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + [p for p in sys.path if p]), PYTHONWARNINGS='ignore',
               OMP_NUM_THREADS='1')
    start = time.monotonic()
    run = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',
                          os.path.join(HERE, 'distributed_worker.py'), str(tmp_path / 'never.pt'),
                          json.dumps(dict(COMMON, per_rank=per_rank))],
                         env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    out = run.stdout + run.stderr
    assert run.returncode != 0 and named in out, out
    assert elapsed < 40, f'took {elapsed:.1f} s'


def test_a_rank_that_dies_mid_step_is_named_by_the_survivor(tmp_path):
    """Python jobs run dkfac's heartbeat watchdog (on a clone of torch's store): when a rank dies, the survivor's
    failed collective names it, as the command line does, instead of 'a peer died' with no rank."""
    start = time.monotonic()
    procs = start_workers(2, dict(COMMON, die_at={'1': 2}), tmp_path)
    outputs = outputs_of(procs, 60)
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 9
    assert procs[0].returncode != 0
    assert re.search(r'lost rank 1 \(no heartbeat for [0-9.]+ s\)', outputs[0]), outputs[0]
    assert elapsed < 30, f'took {elapsed:.1f} s'


@pytest.mark.parametrize('placement', ['replicated', 'owner'])
def test_a_rank_that_dies_under_fsdp2_is_named_by_the_survivor(tmp_path, placement):
    """Under FSDP2 the survivor's first collective in step() is torch's (the sharded gradients' gather): it failed
    with a bare Gloo error ("Connection reset by peer"). Its error now names the lost rank as under DDP."""
    start = time.monotonic()
    procs = start_workers(2, dict(COMMON, shard='fsdp', sharded_placement=placement, die_at={'1': 2}), tmp_path)
    outputs = outputs_of(procs, 60)
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 9
    assert procs[0].returncode != 0
    assert re.search(r'gathering the sharded layers\' gradients failed \(lost rank 1 \(no heartbeat for [0-9.]+ s\)',
                     outputs[0]), outputs[0]
    assert elapsed < 40, f'took {elapsed:.1f} s'


def test_owner_placement_leaves_a_layer_no_rank_ran_to_the_unused_layer_policy(tmp_path):
    """Under FSDP2 a layer that no rank ran has no gradient on any rank: owner placement moves nothing for it, the
    core keeps its plain (absent) gradient under unused_layer_policy='skip', and the job equals the replicated
    placement's, step by step."""
    kwargs = dict(COMMON, unused_layer_policy='skip', skip_at={'0': [1, 2]}, shard='fsdp', strategy='kaisa')
    (tmp_path / 'owner').mkdir(), (tmp_path / 'replicated').mkdir()
    owner = run_workers(2, {**kwargs, 'sharded_placement': 'owner'}, tmp_path / 'owner')
    replicated = run_workers(2, {**kwargs, 'grad_worker_fraction': 0.5}, tmp_path / 'replicated')
    assert len(owner[0]['layers']) == 4  # the block's conv is registered
    for rank, result in enumerate(owner):
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(result['grads'][step], replicated[0]['grads'][step])):
                assert (a is None) == (b is None), f'rank {rank}, step {step}, parameter {i}'
                assert a is None or close(a, b), f'rank {rank}, step {step}, parameter {i}: {(a - b).abs().max()}'
        assert [g is None for g in result['grads'][1]].count(True) == 2, 'the skipped conv has no gradient'


@pytest.mark.parametrize('strategy', [dict(grad_worker_fraction=0.5), dict(strategy='dp')])
def test_a_layer_skipped_on_one_rank_trains_on(tmp_path, strategy):
    """unused_layer_policy='skip' with a block that rank 1 skips at steps 1 and 2 (stochastic depth, DDP's
    find_unused_parameters): it used to abort that rank ("Received data size doesn't match"). The ranks now agree
    at every step, train on, and end with the same gradients."""
    kwargs = dict(COMMON, unused_layer_policy='skip', skip_at={'1': [1, 2]}, **strategy)
    ranks = run_workers(2, kwargs, tmp_path)
    for step in range(STEPS):
        for a, b in zip(ranks[0]['grads'][step], ranks[1]['grads'][step]):
            assert torch.equal(a, b), f'step {step}'
    assert len(ranks[0]['layers']) == 4  # the block's conv is registered
