"""torch.compile: a compiled model trains with K-FAC to the eager model's losses. The capture hooks call into the
C++ core, which Dynamo does not trace: on factor-update steps each K-FAC layer's hook is a graph break (counted
here); on the other steps the hooks return before it and the graph is whole."""

from __future__ import annotations

import pytest
import torch

import dkfac


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def losses(model: torch.nn.Module, *, compiled: str | None, kfac: bool, steps: int = 4) -> list[float]:
    preconditioner = dkfac.KFACPreconditioner(model, kl_clip=None, factor_update_steps=2) if kfac else None
    run = torch.compile(model, backend=compiled) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        loss = run(x).pow(2).mean()
        loss.backward()
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize('backend', ['aot_eager', 'inductor'])
def test_a_compiled_model_trains_to_the_eager_models_losses(backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = losses(make_model(), compiled=None, kfac=True)
    compiled = losses(make_model(), compiled=backend, kfac=True)
    assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-9)
    assert eager[1:] != pytest.approx(losses(make_model(), compiled=None, kfac=False)[1:], rel=1e-6), \
        'K-FAC changed nothing: the comparison could not fail'
    breaks = sum(n for reason, n in counters['graph_break'].items() if 'capture_input' in reason)
    assert breaks >= 1, dict(counters['graph_break'])
