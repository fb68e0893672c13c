"""stack_layers (docs/MATH.md section 2.9): the layers of one shape preconditioned together, from state held as slices
of one stacked tensor per shape, through the Python front end. Exact: equal to the layer-by-layer run to rounding
(float64: 1e-12), with shared A factors and KL clipping, through a state dict that loads into a layer-by-layer run;
on CUDA against the CPU float64 reference (tests/python/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import dkfac


class Stack(torch.nn.Module):
    """Three blocks, each a query, key and value of one input and a mix (16 -> 16 each), between layers of other
    shapes: groups of 9 (3 units of 3 sharing an A side, or 9 alone) and 3."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({name: torch.nn.Linear(16, 16) for name in
                                                               ('query', 'key', 'value', 'mix')}) for _ in range(3))
        self.head = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = torch.tanh(b['mix'](torch.tanh(b['query'](h) * b['key'](h) + b['value'](h))))
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(8, 3, 6, generator=g), torch.randn(8, 3, 4, generator=g)


def train(device: str, dtype: torch.dtype, steps: int, model: Stack | None = None,
          preconditioner: dkfac.KFACPreconditioner | None = None, first: int = 0,
          **kwargs) -> tuple[list[list[torch.Tensor]], Stack, dkfac.KFACPreconditioner]:
    """`steps` SGD steps; each step's gradients after preconditioner.step(), on the CPU in float64."""
    if model is None:
        torch.manual_seed(0)
        model = Stack().to(device, dtype)
    if preconditioner is None:
        preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, inv_update_steps=3, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(first, first + steps):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device, dtype)), y.to(device, dtype)).backward()
        preconditioner.step()
        grads.append([p.grad.to('cpu', torch.float64) for p in model.parameters()])
        optimizer.step()
    return grads, model, preconditioner


def largest_difference(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> float:
    return max(((a - b).norm() / (b.norm() + 1e-300)).item() for g, e in zip(got, expected) for a, b in zip(g, e))


SHARED = dict(shared_input_layers=['(query|key|value)$'])


# pad_widths=8: the [16, 17] layers' stacks held at [16, 24]: per unit 24^2 - 17^2 = 287 entries of A side, per member
# 16 x 24 - 16 x 17 = 112 of denominator (G needs no pad): 6 units and 12 members with shared inputs. The second-order
# state in float64 (kfac_pytorch's default inv_dtype is float32, whose products round differently once padded: to
# 2e-7, which training carries on), so that the comparison is float64's.
PADDED = dict(inv_dtype=torch.float64)  # pad_widths 8, the default
PADDED_BYTES = 8 * (6 * 287 + 12 * 112)


# Unpadded (pad_widths=1), the products are bit for bit layer by layer's on this CPU, float32 state included; padded
# (the default), in float64.
UNPADDED = dict(pad_widths=1)


@pytest.mark.parametrize('kwargs', [UNPADDED, dict(compute_method='inverse', **UNPADDED), dict(**SHARED, **UNPADDED),
                                    dict(compute_method='inverse', **SHARED, **UNPADDED),
                                    dict(second_order_lag=2, **SHARED, **UNPADDED), dict(**PADDED, **SHARED)],
                         ids=['eigen', 'inverse', 'eigen-shared', 'inverse-shared', 'eigen-shared-lag',
                              'eigen-shared-padded'])
def test_stacked_equals_layer_by_layer(kwargs):
    kwargs = dict(kl_clip=1e-4, **kwargs)  # KL clipping's scale below 1 at every step here: its sums are exercised
    stacked, _, p_stacked = train('cpu', torch.float64, 8, **kwargs)
    plain, _, p_plain = train('cpu', torch.float64, 8, stack_layers=False, **kwargs)
    assert largest_difference(stacked, plain) < 1e-12
    usage = p_stacked.memory_usage()
    padding = usage.pop('stack_padding', 0)
    assert padding == (PADDED_BYTES if kwargs.get('pad_widths', 8) > 1 else 0)
    usage['total'] -= padding
    assert usage == p_plain.memory_usage()
    assert p_stacked.stack_layers and not p_plain.stack_layers
    # The live state (the core's, not state_dict()'s copies): the mix layers' G sides are slots of one tensor.
    key = 'g_eigenvectors' if kwargs.get('compute_method', 'eigen') == 'eigen' else 'g_inverse'
    for p, stacked_state in ((p_stacked, True), (p_plain, False)):
        live = dict(zip(p._state_names, p._core.layer_states()))
        storages = {live[f'blocks.{b}.mix'][key].untyped_storage().data_ptr() for b in range(3)}
        assert (len(storages) == 1) == stacked_state, storages


@pytest.mark.parametrize('padding', [UNPADDED, PADDED], ids=['unpadded', 'padded'])
@pytest.mark.parametrize('into_stacked', [False, True], ids=['into-layer-by-layer', 'into-stacked'])
def test_state_dict_of_stacked_layers_loads(into_stacked, padding):
    _, model, stacked = train('cpu', torch.float64, 4, **padding)
    state = stacked.state_dict()
    # Copies, each its own: a slot of a stack is not handed out with its whole storage.
    for name, entries in state['dkfac']['second_order'].items():
        for key, tensor in entries.items():
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), (name, key)
    torch.manual_seed(0)
    restored_model = Stack().to(torch.float64)
    restored_model.load_state_dict(model.state_dict())
    restored = dkfac.KFACPreconditioner(restored_model, damping=0.01, inv_update_steps=3, stack_layers=into_stacked,
                                        **padding)
    if into_stacked:  # a preconditioner that holds stacks of its own already (two steps of its own)
        train('cpu', torch.float64, 2, restored_model, restored, first=100)
        restored_model.load_state_dict(model.state_dict())
    restored.load_state_dict(state)
    got, _, _ = train('cpu', torch.float64, 4, restored_model, restored, first=4)
    expected, _, _ = train('cpu', torch.float64, 4, model, stacked, first=4)
    assert largest_difference(got, expected) < 1e-12


def in_lockstep(first: tuple[Stack, dkfac.KFACPreconditioner], second: tuple[Stack, dkfac.KFACPreconditioner],
                steps: int, start: int = 0, device: str = 'cpu', dtype: torch.dtype = torch.float64) -> list[float]:
    """Each step's largest difference between two runs whose parameters are made the first's after every step, so
    that each step compares the two preconditioners from one state, and rounding is not carried from step to step."""
    differences = []
    for step in range(start, start + steps):
        got = train(device, dtype, 1, *first, first=step)[0]
        expected = train(device, dtype, 1, *second, first=step)[0]
        differences.append(largest_difference(got, expected))
        with torch.no_grad():
            for a, b in zip(first[0].parameters(), second[0].parameters()):
                b.copy_(a)
    return differences


def stack_model(device: str = 'cpu', dtype: torch.dtype = torch.float64, **kwargs) -> tuple[Stack,
                                                                                           dkfac.KFACPreconditioner]:
    torch.manual_seed(0)
    model = Stack().to(device, dtype)
    return model, dkfac.KFACPreconditioner(model, damping=0.01, inv_update_steps=3, **kwargs)


# eigen_adam: the eigenbases stacked (A sides padded as above, no denominator), each layer's Adam moments its own.
# Compared step by step from one state (in_lockstep): Adam's steps carried over a whole run would not compare at
# 1e-12 once padded. A padded product rounds as the unpadded one does not (1e-16), which the next eigendecompositions
# of these nearly degenerate factors turn into another basis of a degenerate subspace (1e-5), in which Adam's second
# moment (not basis-invariant, docs/MATH.md section 8) rotates differently: 1e-7 by step 8, measured.
@pytest.mark.parametrize('kwargs', [UNPADDED, dict(**PADDED, **SHARED), dict(second_order_lag=1, **PADDED)],
                         ids=['unpadded', 'shared-padded', 'lag-padded'])
def test_stacked_eigen_adam_equals_layer_by_layer(kwargs):
    kwargs = dict(kl_clip=0.0, eigen_adam=True, **kwargs)
    stacked, plain = stack_model(**kwargs), stack_model(stack_layers=False, **kwargs)
    differences = in_lockstep(stacked, plain, 10)  # updates at steps 0, 3, 6 and 9: the moments rotated three times
    # Adam's first step divides P by |P| + eps: P's entries that are 0 but for rounding come out at rounding / 1e-8
    # (1e-11 at step 0, padded); from the next step on, rounding's (0 unpadded: bit for bit).
    assert differences[0] < 1e-10 and max(differences[1:]) < 1e-12, differences
    usage = stacked[1].memory_usage()
    padding = usage.pop('stack_padding', 0)
    units = 6 if 'shared_input_layers' in kwargs else 12
    assert padding == (8 * units * 287 if kwargs.get('pad_widths', 8) > 1 else 0)
    usage['total'] -= padding
    assert usage == plain[1].memory_usage()
    live = dict(zip(stacked[1]._state_names, stacked[1]._core.layer_states()))
    assert len({live[f'blocks.{b}.mix']['g_eigenvectors'].untyped_storage().data_ptr() for b in range(3)}) == 1
    # Adam's moments in the state dict, loaded into a layer-by-layer run: the next steps agree.
    restored = stack_model(stack_layers=False, **kwargs)
    restored[0].load_state_dict(stacked[0].state_dict())
    restored[1].load_state_dict(stacked[1].state_dict())
    assert max(in_lockstep(stacked, restored, 4, start=10)) < 1e-12
