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
