"""The one restore (Preconditioner::restore) through Python's load_state_dict: a layer that never built its
factors (unused under unused_layer_policy='skip') neither blocks the resume nor forces the other layers' second-order
state to be recomputed; a dict without layer state keeps each layer's own."""

from __future__ import annotations

import torch

import dkfac


class TwoBranches(torch.nn.Module):
    """`unused` is registered but never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 3)
        self.unused = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def trained(steps: int) -> tuple[torch.nn.Module, dkfac.KFACPreconditioner]:
    torch.manual_seed(0)
    model = TwoBranches()
    preconditioner = dkfac.KFACPreconditioner(model, unused_layer_policy='skip', factor_update_steps=1,
                                              inv_update_steps=3)
    for step in range(steps):
        torch.manual_seed(10 + step)
        model.zero_grad()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        preconditioner.step()
    return model, preconditioner


def test_an_unused_layer_does_not_block_an_exact_resume():
    _, source = trained(5)  # factors updated after the last inverse step (3): a recompute would differ
    saved = source.state_dict()
    _, target = trained(0)
    target.load_state_dict(saved)
    assert target.steps == 5
    want, got = source._core.layer_states(), target._core.layer_states()
    assert sorted(got[0]) == sorted(want[0])
    for key, tensor in want[0].items():
        assert torch.equal(got[0][key], tensor), key  # the used layer's second-order state as saved, not recomputed
    assert 'a_factor' not in got[1], 'the unused layer never built factors'


def test_a_dict_without_layer_state_keeps_each_layers_own():
    _, target = trained(4)
    before = target._core.layer_states()
    target.load_state_dict({'steps': 9})
    assert target.steps == 9
    for have, had in zip(target._core.layer_states(), before):
        assert sorted(have) == sorted(had)
        for key, tensor in had.items():
            assert torch.equal(have[key], tensor), key
