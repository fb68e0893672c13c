"""``eigh_interval`` (a fast mode, docs/MATH.md section 2.6): between full eigendecompositions each inverse update
refreshes the eigenbasis the layer holds by one subspace-iteration step. From Python: the refreshes are the core's
kernel applied to the basis held before the step, the full updates are eigendecompositions, and bad values are
refused naming the option."""

from __future__ import annotations

import pytest
import torch

import dkfac
from dkfac import _C


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def test_refreshes_between_full_decompositions():
    model = make_model()
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, eigh_interval=3,
                                              kl_clip=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    refreshes_unlike_eigh = 0
    for step in range(7):
        before = [{k: v.clone() for k, v in state.items()} for state in preconditioner._core.layer_states()]
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(32, 6)), torch.randn(32, 3)).backward()
        preconditioner.step()
        optimizer.step()
        for i, state in enumerate(preconditioner._core.layer_states()):
            for side in 'ag':
                factor = state[f'{side}_factor']
                vectors, values = state[f'{side}_eigenvectors'], state[f'{side}_eigenvalues']
                full_vectors, full_values = _C.eigen_decompose(factor)
                if step % 3 == 0:  # steps 0, 3 and 6 decompose in full
                    torch.testing.assert_close(values, full_values, rtol=0, atol=1e-6)
                    torch.testing.assert_close((vectors * values) @ vectors.T, factor, rtol=0, atol=1e-5)
                    continue
                expected = _C.refresh_eigenbasis(factor, before[i][f'{side}_eigenvectors'],
                                                 before[i][f'{side}_eigenvalues'])
                torch.testing.assert_close(vectors, expected[0], rtol=0, atol=1e-6)
                torch.testing.assert_close(values, expected[1], rtol=0, atol=1e-6)
                refreshes_unlike_eigh += int((values - full_values).abs().max() > 1e-4)
    assert refreshes_unlike_eigh > 0


def test_bad_values_are_refused_naming_the_option():
    with pytest.raises(ValueError, match='eigh_interval must be >= 1, got 0'):
        dkfac.KFACPreconditioner(make_model(), eigh_interval=0)
    with pytest.raises(ValueError, match='eigh_interval refreshes eigenbases.*compute_method eigen, got inverse'):
        dkfac.KFACPreconditioner(make_model(), compute_method='inverse', eigh_interval=2)
    assert dkfac.KFACPreconditioner(make_model(), eigh_interval=4).eigh_interval == 4
