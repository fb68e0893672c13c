"""The Python front end against the C++ API: same model, weights, batches and options, identical results.

tests/python/cpp_reference.cpp trains the "cnn" scenario with dkfac::nn modules and dkfac::Preconditioner;
the Python side trains stock torch.nn modules with dkfac.KFACPreconditioner. Both feed the same core, so
every preconditioned gradient must be bit for bit equal.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import dkfac
import scenarios

BINARY = os.environ.get('DKFAC_CPP_REFERENCE', os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..',
                                                             'build', 'tests', 'dkfac_cpp_reference'))


@pytest.mark.parametrize('method', ['eigen', 'inverse', 'eigen_adam', 'eigen_refresh', 'eigen_lag'])
def test_python_equals_cpp_api(method, tmp_path):
    if not os.path.exists(BINARY):
        pytest.fail(f'{BINARY} is missing: build the project (./scripts/build.sh) first')
    settings = dict(factor_update_steps=1, inv_update_steps=3, damping=0.003)
    model = scenarios.make_model('cnn')
    batches = [scenarios.batch('cnn', step) for step in range(5)]
    spec = dict(method=method, weights=[p.detach().clone() for p in model.parameters()],
                inputs=[x for x, _ in batches], targets=[y for _, y in batches], **settings)
    torch.save(spec, tmp_path / 'in.pt')
    subprocess.run([BINARY, str(tmp_path / 'in.pt'), str(tmp_path / 'out.pt')], check=True, timeout=120)
    cpp = torch.load(tmp_path / 'out.pt', weights_only=False)  # the C++ reference's own archive

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adam = method == 'eigen_adam'  # Adam in the eigenbasis (docs/MATH.md section 8): no KL clipping
    refresh = method == 'eigen_refresh'  # eigh_interval 2: step 3's inverse update refreshes (docs/MATH.md 2.6)
    lag = int(method == 'eigen_lag')  # second_order_lag 1: step 3's update is installed at step 4 (docs/MATH.md 2.8)
    preconditioner = dkfac.KFACPreconditioner(model, compute_method='inverse' if method == 'inverse' else 'eigen',
                                              eigen_adam=adam, eigh_interval=2 if refresh else 1, lr=0.1,
                                              second_order_lag=lag,
                                              kl_clip=None if adam else 0.001, **settings)
    python = []
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        preconditioner.step()
        python.extend(p.grad.clone() for p in model.parameters())
        optimizer.step()
    assert len(python) == len(cpp)
    for i, (a, b) in enumerate(zip(python, cpp)):
        assert torch.equal(a, b), f'gradient {i} (step {i // 5}, parameter {i % 5}) differs by {(a - b).abs().max()}'


@pytest.mark.parametrize('base', ['sgd', 'eigen_adam', 'graft'])
def test_python_optimizer_equals_the_cpp_optimizer(base, tmp_path):
    """dkfac.optim.KFAC against the C++ dkfac::optim::KFAC: SGD with momentum whose lr changes before each step (as
    a scheduler changes it; both preconditioners' KL clipping follows it), AdamW with eigen_adam (Adam's betas
    taken from the base, AdamW's decoupled update applied by the core's apply_decoupled_step), or the SGD grafted
    (the core's graft_block; torch's AdamW and LibTorch's differ by rounding, their SGDs do not): the parameters
    after every step, bit for bit."""
    if not os.path.exists(BINARY):
        pytest.fail(f'{BINARY} is missing: build the project (./scripts/build.sh) first')
    settings = dict(factor_update_steps=1, inv_update_steps=3, damping=0.003)
    model = scenarios.make_model('cnn')
    batches = [scenarios.batch('cnn', step) for step in range(6)]
    lrs = torch.tensor([0.1, 0.1, 0.05, 0.05, 0.025, 0.025], dtype=torch.float64)
    if base == 'eigen_adam':
        lrs = lrs * 0.03
    spec = dict(method=f'optim_{base}', weights=[p.detach().clone() for p in model.parameters()], lrs=lrs,
                inputs=[x for x, _ in batches], targets=[y for _, y in batches], **settings)
    torch.save(spec, tmp_path / 'in.pt')
    subprocess.run([BINARY, str(tmp_path / 'in.pt'), str(tmp_path / 'out.pt')], check=True, timeout=120)
    cpp = torch.load(tmp_path / 'out.pt', weights_only=False)

    if base == 'eigen_adam':
        opt = dkfac.optim.KFAC(model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95),
                                                        weight_decay=0.1), eigen_adam=True, **settings)
    else:
        opt = dkfac.optim.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), kl_clip=0.001,
                               graft=base == 'graft', **settings)
    python = []
    for (x, y), lr in zip(batches, lrs.tolist()):
        opt.param_groups[0]['lr'] = lr
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        python.extend(p.detach().clone() for p in model.parameters())
    assert len(python) == len(cpp)
    for i, (a, b) in enumerate(zip(python, cpp)):
        assert torch.equal(a, b), f'parameter {i % 5} after step {i // 5} differs by {(a - b).abs().max()}'
    # The runs moved: lr 0 or a base that steps nothing would pass the equality too.
    assert not torch.equal(python[0], spec['weights'][0])
