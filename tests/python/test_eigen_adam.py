"""Adam in the K-FAC eigenbasis (``eigen_adam``, docs/MATH.md section 8) through ``dkfac.optim.KFAC``, against a
float64 reference written here from the formulas: each layer's gradient G [g, a] (bias as the last column) is
projected into the eigenbasis of that step's factors, P = Q_G^T G Q_A (the basis refreshed at every inverse step,
the moments rotated into the new one), Adam's moments of P are kept per entry, and the step Q_G [m-hat / (sqrt(v-hat)
+ eps)] Q_A^T is applied as AdamW applies its own (weight decay decoupled); the parameters outside the K-FAC layers
take torch's AdamW step. The factors are read from the preconditioner's state after each step (their own tests are
elsewhere); everything else is the reference's.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import dkfac
from dkfac import optim

# Adam's quotient m / (sqrt(v) + eps) of an entry whose P is round-off (a direction the layer's inputs or outputs never
# take: after a LayerNorm, A's constant direction) is round-off / eps: eps 1e-4 keeps it at float64's 1e-12 scale.
LR, DECAY, BETAS, EPS = 0.01, 0.1, (0.9, 0.99), 1e-4
STEPS, INV_EVERY = 6, 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.LayerNorm(6),
                               torch.nn.Linear(6, 3)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)


def kfac_optimizer(model: torch.nn.Module, **kwargs) -> optim.KFAC:
    return optim.KFAC(model, adamw(model), eigen_adam=True, factor_update_steps=1, inv_update_steps=INV_EVERY,
                      inv_dtype=torch.float64,
                      **kwargs)


def train(model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def factors_after_step(opt: optim.KFAC) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    layers = opt.preconditioner.state_dict()['layers']
    return {name: (entry['A'].clone(), entry['G'].clone()) for name, entry in layers.items()}


class Reference:
    """Adam in the eigenbasis of one layer, from the formulas, in float64."""

    def __init__(self) -> None:
        self.m = self.v = self.qa = self.qg = None
        self.t = 0

    def step(self, grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, refresh: bool,
             betas: tuple[float, float] = BETAS) -> torch.Tensor:
        if refresh:
            qa, qg = torch.linalg.eigh(a).eigenvectors, torch.linalg.eigh(g).eigenvectors
            if self.m is not None:  # into the new basis: m exactly, v entry-wise (R o R)
                ra, rg = qa.T @ self.qa, qg.T @ self.qg
                self.m = rg @ self.m @ ra.T
                self.v = (rg * rg) @ self.v @ (ra * ra).T
            self.qa, self.qg = qa, qg
        p = self.qg.T @ grad @ self.qa
        if self.m is None:
            self.m, self.v = torch.zeros_like(p), torch.zeros_like(p)
        self.t += 1
        self.m = betas[0] * self.m + (1 - betas[0]) * p
        self.v = betas[1] * self.v + (1 - betas[1]) * p * p
        u = (self.m / (1 - betas[0] ** self.t)) / ((self.v / (1 - betas[1] ** self.t)).sqrt() + EPS)
        return self.qg @ u @ self.qa.T


@pytest.mark.parametrize('cycle_momentum', [False, True], ids=['constant', 'one-cycle'])
def test_eigen_adam_equals_the_float64_reference_with_adamw_on_the_other_parameters(cycle_momentum):
    """With OneCycleLR's momentum cycling (cycle_momentum, its default), the base's beta1 changes at every step:
    the core's Adam follows it, as AdamW does (it used to keep the betas read at construction)."""
    model = make_model()
    expected = copy.deepcopy(model)
    opt = kfac_optimizer(model)
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS + 1, base_momentum=0.8,
                                                     max_momentum=0.95) if cycle_momentum else None)
    assert opt.preconditioner.eigen_adam and not opt.preconditioner.kl_clip
    assert (opt.preconditioner.adam_beta1, opt.preconditioner.adam_beta2, opt.preconditioner.adam_eps) == (*BETAS, EPS)
    kfac_layers = {'0': expected[0], '3': expected[3]}
    others = [p for name, p in expected.named_parameters() if name.split('.')[0] not in kfac_layers]
    other_adamw = torch.optim.AdamW(others, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    references = {name: Reference() for name in kfac_layers}
    betas_seen = set()
    for step in range(STEPS):
        lr, betas = opt.param_groups[0]['lr'], tuple(opt.param_groups[0]['betas'])
        betas_seen.add(betas)
        other_adamw.param_groups[0].update(lr=lr, betas=betas)
        train(model, opt, range(step, step + 1))
        if scheduler is not None:
            scheduler.step()
        factors = factors_after_step(opt)
        x, y = batch(step)
        other_adamw.zero_grad()
        expected.zero_grad()
        torch.nn.functional.cross_entropy(expected(x), y).backward()
        with torch.no_grad():
            for name, layer in kfac_layers.items():
                grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
                a, g = factors[name]
                d = references[name].step(grad, a, g, refresh=step % INV_EVERY == 0, betas=betas)
                for p, dp in ((layer.weight, d[:, :-1]), (layer.bias, d[:, -1])):
                    p.mul_(1 - lr * DECAY).add_(dp, alpha=-lr)
        other_adamw.step()
        for (name, got), want in zip(model.named_parameters(), expected.parameters()):
            # A round-off entry of P (see EPS above) reaches 4e-11 on the layer after the LayerNorm, steady from the
            # second step on, on some CPUs (an AVX-512 Xeon, with or without the schedule; elsewhere 1e-12). Not
            # following the schedule's betas: 1e-2.
            torch.testing.assert_close(got, want, rtol=1e-8 if cycle_momentum else 1e-9, atol=1e-10,
                                       msg=lambda m, s=step, n=name: f'step {s}, {n}: {m}')
    assert len(betas_seen) == (STEPS if cycle_momentum else 1), betas_seen
    assert (opt.preconditioner.adam_beta1, opt.preconditioner.adam_beta2) == betas
    # AdamW kept no state for the preconditioned parameters: Adam's state of those is the core's.
    kfac_params = {id(p) for name in kfac_layers for p in model[int(name)].parameters()}
    assert not any(id(p) in kfac_params for p in opt.state)
    usage = opt.preconditioner.memory_usage()
    assert usage['adam_moments'] == 8 * 2 * (6 * 6 + 3 * 7) + 4 * 2, usage  # m and v in float64, t in float32


def test_the_moments_resume_exactly_from_a_state_dict_with_or_without_second_order():
    model = make_model()
    opt = kfac_optimizer(model)
    train(model, opt, range(0, 3))  # step 2 is an inverse step: a factors-only state recomputes its basis exactly
    saved_model = copy.deepcopy(model.state_dict())
    full = io.BytesIO()
    torch.save(opt.state_dict(), full)
    factors_only = {'base': copy.deepcopy(opt.optimizer.state_dict()),
                    'kfac': copy.deepcopy(opt.preconditioner.state_dict(include_second_order=False))}
    assert {'exp_avg', 'exp_avg_sq', 'adam_steps'} <= set(factors_only['kfac']['dkfac']['second_order']['0'])
    assert 'a_eigenvectors' not in factors_only['kfac']['dkfac']['second_order']['0']
    train(model, opt, range(3, 6))
    for state in (torch.load(io.BytesIO(full.getvalue()), weights_only=False), factors_only):
        resumed = make_model()
        resumed.load_state_dict(saved_model)
        again = kfac_optimizer(resumed)
        again.load_state_dict(state)
        train(resumed, again, range(3, 6))
        for (name, got), want in zip(resumed.named_parameters(), model.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)


def test_without_the_moments_a_resume_starts_them_again():
    """A checkpoint of plain K-FAC (no moments) loads into eigen_adam: the moments start at zero."""
    model = make_model()
    plain = optim.KFAC(model, adamw(model), factor_update_steps=1, inv_update_steps=INV_EVERY)
    train(model, plain, range(0, 2))
    resumed = make_model()
    resumed.load_state_dict(model.state_dict())
    opt = kfac_optimizer(resumed)
    with pytest.warns(UserWarning, match='kl_clip=0.001 is not loaded'):
        opt.preconditioner.load_state_dict(plain.preconditioner.state_dict())
    assert not opt.preconditioner.state_dict()['dkfac']['held']['0']['exp_avg']  # a blank: none held
    train(resumed, opt, range(2, 3))
    assert float(opt.preconditioner.state_dict()['dkfac']['second_order']['0']['adam_steps']) == 1.0


@pytest.mark.parametrize('kwargs,base,error,named', [
    (dict(eigen_adam=True), 'adamw', ValueError, 'kl_clip'),
    (dict(eigen_adam=True, kl_clip=None, compute_method='inverse'), 'adamw', ValueError, 'compute_method eigen'),
    (dict(eigen_adam=True, kl_clip=None, adam_beta1=1.0), 'adamw', ValueError, 'adam_beta1'),
])
def test_the_preconditioner_refuses_what_eigen_adam_cannot_do(kwargs, base, error, named):
    with pytest.raises(error, match=named):
        dkfac.KFACPreconditioner(make_model(), **kwargs)


@pytest.mark.parametrize('base,kwargs,error,named', [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, TypeError, 'AdamW'),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1), {}, ValueError, 'use torch.optim.AdamW'),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True), {}, ValueError, 'amsgrad'),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(graft=True), ValueError, 'graft'),
])
def test_the_optimizer_refuses_a_base_eigen_adam_cannot_stand_for(base, kwargs, error, named):
    model = make_model()
    with pytest.raises(error, match=named):
        optim.KFAC(model, base(model.parameters()), eigen_adam=True, **kwargs)


class _Bag(torch.nn.Module):
    """An Embedding read through a fixed projection: its only parameter is the Embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embedding = torch.nn.Embedding(50, 20)
        self.register_buffer('projection', torch.randn(20, 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).mean(1) @ self.projection


def test_a_layer_whose_two_factors_are_diagonal_takes_adamws_own_step():
    """An Embedding's A is diagonal, and with diagonal_factor_dim 16 its 20-wide G too: both eigenbases are the
    identity, so Adam in the eigenbasis is AdamW on the gradient itself (whose [g, a] view is a transposed one)."""
    model, reference = _Bag().double(), _Bag().double()
    opt = optim.KFAC(model, adamw(model), eigen_adam=True, diagonal_factor_dim=16, factor_update_steps=1,
                     inv_update_steps=2, inv_dtype=torch.float64)  # the moments' dtype (Python's default: float32)
    assert [name for name, _ in opt.preconditioner.layers] == ['embedding']
    plain = adamw(reference)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        ids, y = torch.randint(0, 50, (8, 6), generator=g), torch.randint(0, 3, (8,), generator=g)
        for m, o in ((model, opt), (reference, plain)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(ids), y).backward()
            o.step()
        torch.testing.assert_close(model.embedding.weight, reference.embedding.weight, rtol=1e-12, atol=1e-14)


def test_groups_of_preconditioned_layers_with_other_betas_are_refused():
    """The core runs one Adam over every preconditioned layer: groups of them with other betas or eps (which it
    used to ignore, keeping the defaults') are refused, naming both."""
    model = make_model()
    base = torch.optim.AdamW([{'params': model[0].parameters(), 'betas': (0.5, 0.9)},
                              {'params': [p for m in (model[2], model[3]) for p in m.parameters()]}], lr=LR)
    with pytest.raises(ValueError, match=r'param groups 0 and 1 hold preconditioned layers with \(beta1, beta2, eps\) '
                                         r'\(0\.5, 0\.9, 1e-08\) and \(0\.9, 0\.999, 1e-08\)'):
        optim.KFAC(model, base, eigen_adam=True)
    # A group changed by hand later is refused at the step.
    model = make_model()
    opt = optim.KFAC(model, torch.optim.AdamW([{'params': model[0].parameters()},
                                               {'params': [p for m in (model[2], model[3]) for p in m.parameters()]}],
                                              lr=LR), eigen_adam=True)
    train(model, opt, range(1))
    opt.param_groups[1]['eps'] = 1e-6
    with pytest.raises(ValueError, match='param groups 0 and 1'):
        train(model, opt, range(1, 2))
