"""``start_preconditioning_step``: the K-FAC steps before it build the factors and leave every gradient plain; the
first second-order update runs at it. Checked against runs that start at once (the same factors, step by step, and
from the start step on the same preconditioned gradients) and, through ``dkfac.optim.KFAC``, against the base
optimizer alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dkfac
from dkfac import optim

START = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)


def gradients(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
    model.zero_grad()
    x, y = batch(step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def factors(preconditioner: dkfac.KFACPreconditioner) -> list[torch.Tensor]:
    layers = preconditioner.state_dict()['layers']
    return [layer[key] for layer in layers.values() for key in ('A', 'G')]


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_the_steps_before_the_start_leave_gradients_plain_and_the_rest_equal_a_refresh_there(method):
    # The model is not trained (no optimizer step): both runs see the same gradients at every step. The reference
    # starts at once and refreshes its second order every START steps, so it refreshes at START too.
    options = dict(factor_update_steps=1, inv_update_steps=START, damping=0.01, kl_clip=1e-3, lr=0.1,
                   compute_method=method)
    late_model, reference_model = make_model(), make_model()
    late = dkfac.KFACPreconditioner(late_model, start_preconditioning_step=START, **options)
    reference = dkfac.KFACPreconditioner(reference_model, **options)
    assert late.start_preconditioning_step == START
    for step in range(3 * START):
        plain = gradients(late_model, step)
        gradients(reference_model, step)
        late.step()
        reference.step()
        got = [p.grad for p in late_model.parameters()]
        expected = [p.grad for p in reference_model.parameters()]
        for a, b in zip(factors(late), factors(reference)):
            assert torch.equal(a, b), f'step {step}: the factors differ'
        if step < START:
            for g, p in zip(got, plain):
                assert torch.equal(g, p), f'step {step}: a gradient was preconditioned before the start'
            assert not any(torch.equal(g, p) for g, p in zip(expected, plain)), 'the reference preconditions'
        else:
            for g, e in zip(got, expected):
                assert torch.equal(g, e), f'step {step}: differs from the run that refreshed at {START}'
    assert late.steps == 3 * START


def test_the_optimizer_takes_the_base_step_before_the_start_then_eigen_adam():
    kfac_model = make_model()
    adamw_model = copy.deepcopy(kfac_model)
    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt = optim.KFAC(kfac_model, torch.optim.AdamW(kfac_model.parameters(), **kw), eigen_adam=True,
                     factor_update_steps=1, inv_update_steps=2, start_preconditioning_step=START,
                     inv_dtype=torch.float64)
    base = torch.optim.AdamW(adamw_model.parameters(), **kw)
    opt.preconditioner.start_preconditioning_step = 0  # kfac_pytorch's attributes inform; the core's value rules
    for step in range(START + 2):
        for model, optimizer in ((kfac_model, opt), (adamw_model, base)):
            x, y = batch(step)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        same = all(torch.equal(p, q) for p, q in zip(kfac_model.parameters(), adamw_model.parameters()))
        assert same == (step < START), f'step {step}: AdamW alone before the start, eigen_adam from it'
    assert opt.preconditioner.steps == START + 2


def test_a_bad_start_is_named():
    with pytest.raises(ValueError, match='start_preconditioning_step'):
        dkfac.KFACPreconditioner(make_model(), start_preconditioning_step=-1)
