"""Pipeline parallel (torch.distributed.pipelining): each stage preconditions its own layers with factors
accumulated over the schedule's micro-batches, averaged over its data-parallel group, and KL clipping summed over
its replica's stages; the job equals one process preconditioning the whole model over the same micro-batches."""
import functools

import pytest
import torch

import dkfac
import pipeline_worker as worker
import workers

run = functools.partial(workers.run_workers, 'pipeline_worker.py')


def reference(dp: int, kind: str = 'mlp') -> list[list[torch.Tensor]]:
    """The whole model in one process: every replica's micro-batches, each loss's gradient summed and divided by
    their number (as the schedule scales them and the replicas average), factors over all of them."""
    model = worker.model(kind)
    preconditioner = dkfac.KFACPreconditioner(model, accumulation_steps=worker.MICRO * dp, **worker.KFAC)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(worker.STEPS):
        optimizer.zero_grad()
        for replica in range(dp):
            x, y = worker.data(step, replica, kind)
            for xm, ym in zip(x.chunk(worker.MICRO), y.chunk(worker.MICRO)):
                worker.loss_fn(model(xm), ym).backward()
        for p in model.parameters():
            p.grad /= worker.MICRO * dp
        preconditioner.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads


@pytest.mark.parametrize('schedule,dp,kind', [('gpipe', 1, 'mlp'), ('1f1b', 1, 'mlp'), ('1f1b', 2, 'mlp'),
                                              ('1f1b', 1, 'lm')])
def test_pipeline_stages_equal_the_whole_model_in_one_process(schedule, dp, kind, tmp_path):
    """'lm': an Embedding (diagonal A) and a Conv1D on stage 0, a LayerNorm (left to the optimizer) and the head."""
    results = run(2 * dp, {'schedule': schedule, 'dp': dp, 'model': kind}, tmp_path)
    expected = reference(dp, kind)
    assert any(abs(a - b).max() > 1e-3 for a, b in zip(expected[1], reference_without_clip(dp, kind)[1])), \
        'KL clipping must act in this test, or a stage summing only its own layers would pass'
    for rank, result in enumerate(results):
        assert 'error' not in result, result
        # 'lm' builds each stage as a new Sequential, so both name a layer '1' (a DCP checkpoint would keep one of
        # them); 'mlp' slices the whole model's, whose names the stages keep.
        named_alike = [w for w in result['warnings'] if "both hold a K-FAC layer named '1'" in w]
        assert bool(named_alike) == (kind == 'lm'), result['warnings']
        held = worker.stage_parameters(kind, result['stage'])
        for step in range(worker.STEPS):
            assert len(result['grads'][step]) == len(expected[step][held])
            for got, want in zip(result['grads'][step], expected[step][held]):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13, msg=f'rank {rank}, step {step}')


@pytest.mark.parametrize('placement,kind', [('replicated', 'lm'), ('owner', 'mlp'), ('owner', 'lm')])
def test_pipeline_stages_sharded_by_fsdp2_equal_the_whole_model_in_one_process(placement, kind, tmp_path):
    """pp 2 x dp_shard 2: each stage sharded by fully_shard over its data-parallel ranks (the schedule reduces its
    gradients at the last micro-batch), in either placement of the sharded layers."""
    results = run(4, {'schedule': '1f1b', 'dp': 2, 'model': kind, 'fsdp': True,
                      'stage_options': {str(s): {'sharded_placement': placement} for s in range(2)}}, tmp_path)
    expected = reference(2, kind)
    for stage in range(2):  # the K-FAC state each of the stage's ranks holds: every layer's, or its own layers'
        states = [result['state']['layers'] for result in results if result.get('stage') == stage]
        holders = {name: sum(bool(state[name]) for state in states) for name in states[0]}
        assert set(holders.values()) == {1 if placement == 'owner' else 2}, holders
    for rank, result in enumerate(results):
        assert 'error' not in result, result
        assert all(result['sharded']), result['sharded']
        held = worker.stage_parameters(kind, result['stage'])
        for step in range(worker.STEPS):
            for got, want in zip(result['grads'][step], expected[step][held], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13, msg=f'rank {rank}, step {step}')


def reference_without_clip(dp: int, kind: str) -> list[list[torch.Tensor]]:
    kfac = worker.KFAC
    try:
        worker.KFAC = {**kfac, 'kl_clip': None}
        return reference(dp, kind)
    finally:
        worker.KFAC = kfac


def test_a_stage_whose_replicas_count_other_micro_batches_is_refused(tmp_path):
    results = run(4, {'schedule': 'gpipe', 'dp': 2, 'mismatch': True}, tmp_path)
    for rank in (0, 2):  # stage 0's data-parallel group: rank 2 declares one more micro-batch
        assert 'accumulation_steps' in results[rank]['error'], results[rank]
        assert "process_group's rank i is global rank [0, 2][i]" in results[rank]['error'], results[rank]
    for rank in (1, 3):  # stage 1's preconditioners compare their options with stage 0's, which was not built
        assert "comparing the options of the model's parts (ranks [" in results[rank]['error'], results[rank]
        assert "another part's preconditioner was not built" in results[rank]['error'], results[rank]


def test_stages_built_with_other_options_are_refused_on_every_rank(tmp_path):
    """The stages sum KL clipping together: stage 1 built with kl_clip=None left stage 0 waiting in the sum for
    the process group's timeout, silently. Every rank now raises at construction, naming the option and ranks."""
    for result in run(2, {'schedule': 'gpipe', 'dp': 1, 'stage_options': {'1': {'kl_clip': None}}}, tmp_path):
        assert "the model's parts (ranks [0, 1], model_parallel_group) built their preconditioners differently: " \
               'rank 1 has kl_clip=0.0 where rank 0 has kl_clip=0.001' in result['error'], result

