"""torch.nn.Conv1d is preconditioned as the Conv2d of kernel height 1 it is (docs/MATH.md section 1.3): its capture
sees its input and output gradient with a height of 1, and the core binds its weight [C_out, C_in, k] as that
Conv2d's without the height. Each step equals, bit for bit, the same model written with such Conv2d layers, for every
padding, padding mode, stride, dilation and bias; unbatched inputs, torch.compile, groups and skip_layers too. (It
used to keep its plain gradient, logged at the preconditioner's loglevel only: a 1-D CNN trained with K-FAC on its
head alone.)"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import dkfac


class _Lift(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-2)


class _Drop(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.squeeze(-2)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 3, 17, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _models(padding: int | str, mode: str, stride: int, dilation: int, bias: bool):
    """A Conv1d model and the same function with Conv2d layers of kernel height 1, the same weights."""
    torch.manual_seed(0)
    second = 'same' if stride == 1 else 0
    one = torch.nn.Sequential(
        torch.nn.Conv1d(3, 5, 3, stride=stride, dilation=dilation, padding=padding, padding_mode=mode, bias=bias),
        torch.nn.Tanh(), torch.nn.Conv1d(5, 4, 2, padding=second), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    two = torch.nn.Sequential(
        _Lift(), torch.nn.Conv2d(3, 5, (1, 3), stride=(1, stride), dilation=(1, dilation),
                                 padding=padding if isinstance(padding, str) else (0, padding), padding_mode=mode,
                                 bias=bias),
        torch.nn.Tanh(), torch.nn.Conv2d(5, 4, (1, 2), padding=second), _Drop(), torch.nn.Flatten(),
        torch.nn.LazyLinear(2))
    one.double()(_batch(0))
    two.double()(_batch(0))
    with torch.no_grad():
        for a, b in zip(one.parameters(), two.parameters()):
            b.copy_(a.view_as(b))
    return one, two


def _steps(model: torch.nn.Module, preconditioner: dkfac.KFACPreconditioner, steps: int = 3, run=None,
           plain: list | None = None):
    """Each step's gradients after step() (and, into `plain`, before it)."""
    grads = []
    for step in range(steps):
        model.zero_grad()
        (run or model)(_batch(step)).pow(2).sum().backward()
        if plain is not None:
            plain.append([p.grad.reshape(-1).clone() for p in model.parameters()])
        preconditioner.step()
        grads.append([p.grad.reshape(-1).clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
    return grads


@pytest.mark.parametrize('padding,mode,stride,dilation,bias', [
    case for case in itertools.product([0, 2, 'same', 'valid'], ['zeros', 'reflect', 'circular'], [1, 2], [1, 2],
                                       [True, False])
    if not (case[0] == 'same' and case[2] != 1)])
def test_a_conv1d_equals_the_conv2d_of_kernel_height_1(padding, mode, stride, dilation, bias):
    one, two = _models(padding, mode, stride, dilation, bias)
    options = dict(factor_update_steps=1, inv_update_steps=2, damping=0.01)
    first = dkfac.KFACPreconditioner(one, **options)
    assert [name for name, _ in first.layers] == ['0', '2', '4']
    expected = _steps(two, dkfac.KFACPreconditioner(two, **options))
    plain = []
    got = _steps(one, first, plain=plain)
    assert all(torch.equal(a, b) for g, e in zip(got, expected) for a, b in zip(g, e))
    assert not torch.allclose(got[0][0], plain[0][0]), 'K-FAC changed nothing: the comparison could not fail'


def test_an_unbatched_conv1d_input_is_a_batch_of_one():
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv1d(3, 5, 3), torch.nn.Tanh(), torch.nn.Conv1d(5, 2, 2)).double()

    grads = []
    for unbatched in (True, False):
        model = make()
        preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        x = _batch(0)[0]
        model(x if unbatched else x.unsqueeze(0)).pow(2).sum().backward()
        preconditioner.step()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_compiled_conv1d_model_trains_to_the_eager_models_kfac_gradients():
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        model, _ = _models(1, 'zeros', 1, 1, True)
        preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2, damping=0.01)
        run = torch.compile(model, backend='aot_eager') if compiled else model
        results.append(_steps(model, preconditioner, run=run))
    for got, expected in zip(*results):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_a_grouped_conv1d_keeps_its_plain_gradient_and_skip_layers_takes_the_class_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3, groups=4), torch.nn.Conv1d(4, 6, 1), torch.nn.Flatten(),
                                torch.nn.Linear(6 * 5, 2))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        grouped = dkfac.KFACPreconditioner(model)
    assert [name for name, _ in grouped.layers] == ['1', '3']
    del grouped
    skipped = dkfac.KFACPreconditioner(model, skip_layers=['Conv1d'])
    assert [name for name, _ in skipped.layers] == ['3']


def test_weight_layers_of_other_kinds_are_named_in_a_warning():
    """A Conv3d, a transposed convolution or a Bilinear keeps its plain gradient: said in a warning naming them
    (it was logged at the preconditioner's loglevel only, DEBUG by default); a frozen one is not named."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(54, 4),
                                torch.nn.Unflatten(1, (1, 4)), torch.nn.ConvTranspose1d(1, 2, 3),
                                torch.nn.ConvTranspose1d(2, 2, 1))
    model[5].requires_grad_(False)
    with pytest.warns(UserWarning, match=r"2 layer\(s\) of kinds K-FAC does not precondition keep their plain "
                                         r"gradient: '0' \(Conv3d\), '4' \(ConvTranspose1d\) \(K-FAC preconditions"):
        preconditioner = dkfac.KFACPreconditioner(model)
    assert [name for name, _ in preconditioner.layers] == ['2']
    del preconditioner
    with pytest.warns(UserWarning) as said:
        dkfac.KFACPreconditioner(model, skip_layers=['Conv3d'])  # named by skip_layers: not in the warning
    kinds = [str(w.message) for w in said if 'kinds K-FAC does not precondition' in str(w.message)]
    assert len(kinds) == 1 and "'4' (ConvTranspose1d)" in kinds[0] and 'Conv3d' not in kinds[0], kinds
    assert said[0].filename == __file__, 'the warning names the line that built the preconditioner'
    # Patterns are the core's ECMAScript, for these modules too: a POSIX class, which Python's re reads as a set of
    # ':', 'd', 'g', 'i', 't' followed by ']' (and so named the Conv3d the pattern skips).
    with pytest.warns(UserWarning) as said:
        dkfac.KFACPreconditioner(model, skip_layers=['Conv[[:digit:]]d'])
    kinds = [str(w.message) for w in said if 'kinds K-FAC does not precondition' in str(w.message)]
    assert len(kinds) == 1 and 'Conv3d' not in kinds[0], kinds


class _FusedExperts(torch.nn.Module):
    """As transformers 5's mixtures of experts: every expert's weight in one 3-D Parameter, applied by einsum."""

    def __init__(self, experts: int, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, width, width) / width)
        self.position = torch.nn.Parameter(torch.zeros(1, width))  # small: not a share worth a word alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum('bd,edf->bf', x + self.position, self.weight)


def test_a_large_share_of_weights_held_outside_any_layer_is_named_in_a_warning():
    """A mixture of experts' fused experts (3-D Parameters) held 90% of a tiny Mixtral's parameters and kept their
    plain gradient with a word at the loglevel only. Where such weights are 10% or more of what trains, a warning
    names the share and the modules; a small one (a position Parameter) alone is not named."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _FusedExperts(4, 16), torch.nn.Linear(16, 2))
    with pytest.warns(UserWarning, match=r"(\d+)% of the trainable parameters are weights that modules hold "
                                         r"themselves.*'1' \(_FusedExperts: weight \[4, 16, 16\], position \[1, 16\]\)"):
        dkfac.KFACPreconditioner(model)
    small = torch.nn.Sequential(torch.nn.Linear(8, 160), _FusedExperts(1, 4), torch.nn.Linear(4, 2))
    small[1] = torch.nn.Identity()
    small.add_module('extra', torch.nn.Module())
    small.extra.register_parameter('position', torch.nn.Parameter(torch.zeros(1, 4)))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        dkfac.KFACPreconditioner(small)
    assert not [w for w in said if 'modules hold themselves' in str(w.message)], [str(w.message) for w in said]


def test_a_weight_normed_grouped_conv1d_is_named_for_its_weight_norm():
    """Wav2Vec2's positional convolution (grouped, under weight_norm) was named 'a grouped ParametrizedConv1d';
    the reason that sets it aside whatever its groups now comes first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3, groups=2), torch.nn.Flatten(), torch.nn.Linear(28, 2))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        dkfac.KFACPreconditioner(model)
    named = [str(w.message) for w in said if "'0' (ParametrizedConv1d)" in str(w.message)]
    assert len(named) == 1 and 'computed by torch.nn.utils.parametrize' in named[0], named
