"""fold_in_hooks (docs/MATH.md section 1.8) through the Python front end: each layer's factor batches are folded into
its running factors in its backward hook. The run equals fold_in_hooks=False bit for bit, and no batch is held from
the backward pass to step(), with or without accumulation, for Linear, Conv2d and Embedding layers."""

from __future__ import annotations

import warnings

import pytest
import torch

import dkfac


class Net(torch.nn.Module):
    """An Embedding (diagonal A), a Conv2d and two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.fc = torch.nn.Linear(3 * 4 * 4 + 4, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        h = torch.cat([torch.tanh(self.conv(images)).flatten(1), self.embed(tokens)], 1)
        return self.head(torch.tanh(self.fc(h)))


def backward(model: Net, step: int, micro: int, passes: int, device: str = 'cpu',
             dtype: torch.dtype = torch.float64) -> None:
    g = torch.Generator().manual_seed(70 + 11 * step + micro)
    tokens = torch.randint(0, 10, (6,), generator=g).to(device)
    images = torch.randn(6, 2, 4, 4, generator=g, dtype=torch.float64).to(device, dtype)
    target = torch.randn(6, 3, generator=g, dtype=torch.float64).to(device, dtype)
    (torch.nn.functional.mse_loss(model(tokens, images), target) / passes).backward()


def run(passes: int, steps: int, device: str = 'cpu', dtype: torch.dtype = torch.float64,
        **kwargs) -> tuple[list[list[torch.Tensor]], list[int], dkfac.KFACPreconditioner]:
    """`steps` SGD steps of `passes` micro-batches each: every step's preconditioned gradients (on the CPU in
    float64), and the bytes of captured batches held when each backward pass ends."""
    torch.manual_seed(0)
    model = Net().double().to(device, dtype)
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, kl_clip=1e-4, inv_update_steps=2,
                                              accumulation_steps=passes, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    grads, held = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(passes):
            backward(model, step, micro, passes, device, dtype)
        usage = preconditioner.memory_usage()
        held.append(usage['a_batch'] + usage['g_batch'])
        preconditioner.step()
        grads.append([p.grad.to('cpu', torch.float64) for p in model.parameters()])
        optimizer.step()
    return grads, held, preconditioner


@pytest.mark.parametrize('passes', [1, 3])
@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_fold_in_hooks_equals_folding_at_step(passes, method):
    hooked, held, p_hooked = run(passes, 6, compute_method=method)
    plain, held_plain, p_plain = run(passes, 6, compute_method=method, fold_in_hooks=False)
    assert p_hooked.fold_in_hooks and not p_plain.fold_in_hooks
    for step, (got, want) in enumerate(zip(hooked, plain)):
        for a, b in zip(got, want):
            assert torch.equal(a, b), f'step {step}'
    # The first factor update folds at step(), every later one in the hooks; held until step() with the option off.
    assert held[0] > 0 and all(h == 0 for h in held[1:]), held
    assert all(h > 0 for h in held_plain), held_plain
    for got, want in zip(p_hooked._core.layer_states(), p_plain._core.layer_states()):  # factors, second order
        assert got.keys() == want.keys()
        assert all(torch.equal(got[key], want[key]) for key in got), got.keys()


def test_more_passes_than_declared_are_named():
    """A layer armed by one pass per step that is given two passes keeps the pass its hook folded, drops the other,
    and says so; it folds at step() from then on."""
    torch.manual_seed(0)
    model = Net().double()
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01)
    for step in range(3):
        model.zero_grad()
        backward(model, step, 0, 1)
        if step == 2:
            backward(model, step, 1, 1)
            with pytest.warns(UserWarning, match=r'ran 1 forward and 1 backward passes after the 1 '
                                                 r'\(accumulation_steps\) its backward hook had folded into its '
                                                 r'factors this step; they are dropped'):
                preconditioner.step()
        else:
            preconditioner.step()
    model.zero_grad()
    backward(model, 3, 0, 1)
    assert preconditioner.memory_usage()['a_batch'] > 0


class Attention(torch.nn.Module):
    """Query, key and value given one tensor (a shared-input group under shared_input_layers), and an output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.query = torch.nn.Linear(8, 8)
        self.key = torch.nn.Linear(8, 8)
        self.value = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))  # [B, T, 8]
        scores = torch.softmax(self.query(h) @ self.key(h).transpose(1, 2), -1)
        return self.out(scores @ self.value(h)).mean(1)


@pytest.mark.parametrize('passes', [1, 3])
def test_a_shared_input_group_folds_as_one_in_the_hooks(passes):
    """The group's one A and each member's G are folded in the hook of the member whose backward comes last: equal
    bit for bit to folding at step(), and nothing held from the second factor update on."""
    def attention_run(**kwargs):
        torch.manual_seed(0)
        model = Attention().double()
        preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, kl_clip=1e-4, inv_update_steps=2,
                                                  accumulation_steps=passes,
                                                  shared_input_layers=[r'(query|key|value)$'], **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        grads, held = [], []
        for step in range(5):
            optimizer.zero_grad()
            for micro in range(passes):
                g = torch.Generator().manual_seed(90 + 7 * step + micro)
                x = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)
                y = torch.randn(4, 3, generator=g, dtype=torch.float64)
                (torch.nn.functional.mse_loss(model(x), y) / passes).backward()
            usage = preconditioner.memory_usage()
            held.append(usage['a_batch'] + usage['g_batch'])
            preconditioner.step()
            grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
        return grads, held

    hooked, held = attention_run()
    plain, held_plain = attention_run(fold_in_hooks=False)
    for step, (got, want) in enumerate(zip(hooked, plain)):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f'step {step}'
    assert held[0] > 0 and all(h == 0 for h in held[1:]), held
    assert all(h > 0 for h in held_plain), held_plain


@pytest.mark.parametrize('fold_in_hooks', [True, False], ids=['fold', 'no-fold'])
def test_a_batch_folded_in_the_hooks_that_a_skip_or_a_save_cannot_undo_is_said(fold_in_hooks):
    """A loop that skips a step after its backward pass (a loss spike: reset_batch()) or saves between backward and
    step() (a pre-emption handler): with fold_in_hooks the hooks have folded that batch into the factors already,
    where it stays, and a resume that repeats the step counts it twice. Both are said (reset_batch once), and
    neither without the option (which drops the batch and saves without it). They said nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, fold_in_hooks=fold_in_hooks)
    x = torch.randn(8, 4, dtype=torch.float64)

    def backward():
        model.zero_grad()
        model(x).pow(2).mean().backward()

    backward()
    preconditioner.step()  # the first update folds at step(); the hooks fold from the next one on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(2):
            backward()
            preconditioner.reset_batch()
        backward()
        state = preconditioner.state_dict()
        preconditioner.step()
        preconditioner.state_dict()
    said = [str(w.message) for w in caught if 'folded' in str(w.message)]
    if not fold_in_hooks:
        assert said == [], said
        return
    assert len(said) == 2, said
    assert 'reset_batch(): the backward hooks of 2 layer(s) had already folded' in said[0], said
    assert 'fold_in_hooks=False' in said[0] and '(warned once)' in said[0], said
    assert "state_dict(): the factors of 2 layer(s) already hold this step's batch" in said[1], said
    assert state['steps'] == 1
