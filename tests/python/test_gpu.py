"""dkfac on CUDA tensors (pytest -m gpu; scripts/gpu_check.sh): against the CPU float64 reference, with at most one
host synchronisation per step, under torch.autocast with torch.amp.GradScaler, and under torch.distributed (NCCL for
one rank; two ranks sharing the GPU through Gloo) against the single-process reference. Without a CUDA device every
test here is skipped with the reason."""

from __future__ import annotations

import warnings

import pytest
import torch

import dkfac
import scenarios
from test_distributed import close
from test_distributed import COMMON
from test_distributed import reference
from test_distributed import run_workers
from test_distributed import STEPS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason='no CUDA device visible: GPU tests run on a GPU machine '
                                                         '(scripts/gpu_check.sh)')]


def train(device: str, dtype: torch.dtype, steps: int = 4, **kwargs) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = scenarios.make_model('cnn').to(device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, inv_update_steps=2, **kwargs)
    grads = []
    for step in range(steps):
        x, y = scenarios.batch('cnn', step, size=16)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device, dtype)), y.to(device)).backward()
        preconditioner.step()
        grads.append([p.grad.to('cpu', torch.float64) for p in model.parameters()])
        optimizer.step()
    return grads


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_cuda_float32_matches_cpu_float64(method):
    expected = train('cpu', torch.float64, compute_method=method)
    got = train('cuda', torch.float32, compute_method=method)
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


@pytest.mark.parametrize('storage', [torch.bfloat16, torch.float16])
def test_half_storage_matches_cpu_with_the_same_storage(storage):
    kwargs = dict(factor_dtype=storage, inv_dtype=storage)
    expected = train('cpu', torch.float32, **kwargs)
    got = train('cuda', torch.float32, **kwargs)
    rtol = 3e-2 if storage is torch.bfloat16 else 5e-3
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= rtol * b.norm() + 1e-8, f'step {step}, parameter {i}'


def test_step_synchronises_at_most_once():
    model = scenarios.make_model('cnn').cuda()
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, inv_update_steps=100)
    for step in range(4):
        x, y = scenarios.batch('cnn', step, size=16)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('warn')
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                preconditioner.step()
        finally:
            torch.cuda.set_sync_debug_mode('default')
        syncs = [w for w in caught if 'synchroniz' in str(w.message)]
        if step >= 1:  # step 0 decomposes (torch.linalg.eigh checks its result on the host) and folds first factors
            assert len(syncs) <= 1, f'step {step}: {len(syncs)} host synchronisations: {[str(w.message) for w in syncs]}'


def test_autocast_with_grad_scaler_divides_g():
    """The real GradScaler on CUDA under float16 autocast: G comes from the unscaled output gradients."""
    def factors(scaler):
        torch.manual_seed(0)
        model = scenarios.make_model('cnn').cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, grad_scaler=scaler)
        x, y = scenarios.batch('cnn', 0, size=16)
        with torch.autocast('cuda', dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        preconditioner.step()
        return preconditioner.state_dict()['layers']

    plain = factors(None)
    scaled = factors(torch.amp.GradScaler('cuda', init_scale=2.0 ** 12))
    for name in plain:
        # A power-of-two scale is exact in float16, so G is the same up to the factor's own rounding.
        assert torch.allclose(scaled[name]['G'], plain[name]['G'], rtol=1e-3, atol=1e-6), name
        assert torch.equal(scaled[name]['A'], plain[name]['A']), name


def test_nccl_serves_a_one_rank_job(tmp_path):
    results = run_workers(1, {**COMMON, 'device': 'cuda', 'backend': 'nccl'}, tmp_path)
    expected = reference(1, COMMON)
    for step in range(STEPS):
        for a, b in zip(results[0]['grads'][step], expected[step]):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8


@pytest.mark.parametrize('kwargs', [dict(strategy='kaisa', grad_worker_fraction=1.0),
                                    dict(strategy='kaisa', grad_worker_fraction=0.5, compute_method='inverse'),
                                    dict(strategy='spd')], ids=['kaisa-1', 'kaisa-0.5-inverse', 'spd'])
def test_two_ranks_share_the_gpu_through_gloo(kwargs, tmp_path):
    results = run_workers(2, {**COMMON, **kwargs, 'device': 'cuda', 'backend': 'gloo'}, tmp_path)
    expected = reference(2, {**COMMON, **kwargs})
    for rank, result in enumerate(results):
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(result['grads'][step], expected[step])):
                assert close(a, b), f'rank {rank}, step {step}, parameter {i}: max diff {(a - b).abs().max()}'
