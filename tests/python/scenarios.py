"""Deterministic training scenarios run by both kfac_pytorch (golden values) and dkfac (the tests).

`run(module, name)` trains the scenario's model with `module.preconditioner.KFACPreconditioner` (`module`
is `kfac` or `dkfac`) and returns every step's preconditioned gradients and the final parameters.
"""

from __future__ import annotations

import copy

import torch

STEPS = 6


class Conv1D(torch.nn.Module):
    """transformers.pytorch_utils.Conv1D as written there (a Linear whose weight is stored [in, out])."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(x.size()[:-1] + (self.nf,))


class TinyLanguageModel(torch.nn.Module):
    """Token embedding, a Conv1D, a LayerNorm and a 40-token head: the layer kinds of GPT-2, untied."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(LM_VOCABULARY, 8)
        self.c_fc = Conv1D(12, 8)
        self.ln = torch.nn.LayerNorm(12)
        self.head = torch.nn.Linear(12, LM_VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(torch.tanh(self.c_fc(self.wte(tokens)))))


LM_VOCABULARY = 40


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == 'lm':
        return TinyLanguageModel()
    if kind == 'mlp3d':  # Linear on [B, T, in]: leading dimensions flattened into rows
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
    if kind == 'cnn':
        return torch.nn.Sequential(
            torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(4, 4, 3, stride=2, bias=False), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 3, 5),
        )
    raise ValueError(kind)


def batch(kind: str, step: int, micro: int = 0, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    if kind == 'mlp3d':
        return torch.randn(size, 3, 6, generator=g), torch.randn(size, 3, 5, generator=g)
    if kind == 'lm':  # 5 tokens per sample, the target the next token (of 6 drawn)
        tokens = torch.randint(0, LM_VOCABULARY, (size, 6), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(size, 2, 8, 8, generator=g), torch.randint(0, 5, (size,), generator=g)


def loss_of(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == 'mlp3d':
        return torch.nn.functional.mse_loss(output, target)
    if kind == 'lm':
        return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
    return torch.nn.functional.cross_entropy(output, target)


# name -> (model, preconditioner kwargs, micro-batches per step, scheduler lambdas)
SCENARIOS = {
    'mlp3d_eigen': ('mlp3d', dict(factor_update_steps=1, inv_update_steps=2, damping=0.01, lr=0.1), 1, None),
    'cnn_eigen': ('cnn', dict(factor_update_steps=1, inv_update_steps=3, damping=0.003, lr=0.1), 1, None),
    'cnn_inverse': ('cnn', dict(compute_method='inverse', factor_update_steps=2, inv_update_steps=2, damping=0.01), 1,
                    None),
    'cnn_accumulation': ('cnn', dict(accumulation_steps=2, inv_update_steps=2, damping=0.01), 2, None),
    'cnn_schedules': ('cnn', dict(
        damping=lambda s: 0.03 / (1 + s), lr=lambda s: 0.1 * 0.9 ** s, factor_decay=lambda s: min(1 - 1 / max(s, 1), 0.9),
        kl_clip=lambda s: 0.001 * (s + 1), factor_update_steps=lambda s: 1 if s < 3 else 2,
        inv_update_steps=lambda s: 2), 1, None),
    'cnn_no_outer_product': ('cnn', dict(compute_eigenvalue_outer_product=False, damping=lambda s: 0.05 / (1 + s),
                                         inv_update_steps=3), 1, None),
    'cnn_skip_layers': ('cnn', dict(skip_layers=['^1$', 'Linear'], damping=0.01), 1, None),
    'mlp3d_lambda_scheduler': ('mlp3d', dict(damping=0.01, kl_clip=0.01), 1,
                               dict(damping_lambda=lambda s: 0.5, kl_clip_lambda=lambda s: 0.9)),
}


def run(module, name: str, *, steps: int = STEPS, model: torch.nn.Module | None = None,
        state: dict | None = None, start: int = 0) -> dict:
    """Trains scenario `name` with `module`'s KFACPreconditioner (optionally from a state dict)."""
    kind, kwargs, micro, lambdas = SCENARIOS[name]
    model = model if model is not None else make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    preconditioner = module.preconditioner.KFACPreconditioner(model, **kwargs)
    if state is not None:
        preconditioner.load_state_dict(copy.deepcopy(state))
    scheduler = module.scheduler.LambdaParamScheduler(preconditioner, **lambdas) if lambdas else None
    grads = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        for m in range(micro):
            x, y = batch(kind, step, m)
            (loss_of(kind, model(x), y) / micro).backward()
        preconditioner.step()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {
        'grads': grads,
        'params': [p.detach().clone() for p in model.parameters()],
        'state': preconditioner.state_dict(),
        'model': model,
    }
