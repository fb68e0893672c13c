"""Transformer layers (docs/MATH.md section 6): transformers' Conv1D, torch.nn.Embedding, diagonal factors for
vocabulary-sized dimensions and tied weights, each against a dense float64 reference; Hugging Face GPT-2 and BERT
built from configs (never downloaded) register what a user expects, by kind."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings

import pytest
import torch

import dkfac

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
HAVE_TRANSFORMERS = importlib.util.find_spec('transformers') is not None
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason='transformers is not installed '
                                        '(scripts/requirements.txt installs it)')


class Conv1D(torch.nn.Module):
    """transformers.pytorch_utils.Conv1D as it is written there: a Linear whose weight is stored [in, out]."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = torch.nn.Parameter(torch.empty(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))
        torch.nn.init.normal_(self.weight, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def conv1d_classes() -> list:
    classes = [Conv1D]
    if HAVE_TRANSFORMERS:
        from transformers.pytorch_utils import Conv1D as HuggingFaceConv1D
        classes.append(HuggingFaceConv1D)
    return classes


def preconditioned(model, preconditioner, batches, loss_of):
    """The preconditioned gradients of every parameter at each step (SGD applies them)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for batch in batches:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        preconditioner.step()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return out


@pytest.mark.parametrize('conv1d', conv1d_classes(), ids=lambda c: c.__module__)
def test_conv1d_is_preconditioned_as_the_linear_it_is(conv1d):
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    transposed = torch.nn.Sequential(conv1d(6, 5), torch.nn.Tanh(), conv1d(3, 6)).double()
    with torch.no_grad():
        for lin, conv in ((linear[0], transposed[0]), (linear[2], transposed[2])):
            conv.weight.copy_(lin.weight.t())
            conv.bias.copy_(lin.bias)
    batches = [torch.randn(4, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    loss = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    kfac_linear = dkfac.KFACPreconditioner(linear, kl_clip=None, inv_dtype=torch.float64)
    kfac_transposed = dkfac.KFACPreconditioner(transposed, kl_clip=None, inv_dtype=torch.float64)
    assert [type(m).__name__ for _, m in kfac_transposed.layers] == ['Conv1D', 'Conv1D']
    want = preconditioned(linear, kfac_linear, batches, loss)
    got = preconditioned(transposed, kfac_transposed, batches, loss)
    for step_want, step_got in zip(want, got):
        for i in (0, 2):
            torch.testing.assert_close(step_got[f'{i}.weight'], step_want[f'{i}.weight'].t(), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(step_got[f'{i}.bias'], step_want[f'{i}.bias'], rtol=1e-10, atol=1e-12)


class OneHot(torch.nn.Module):
    def __init__(self, vocabulary: int) -> None:
        super().__init__()
        self.vocabulary = vocabulary

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(tokens, self.vocabulary).double()


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_embedding_is_the_linear_of_one_hot_rows(method):
    torch.manual_seed(1)
    vocabulary, dim = 9, 4
    embedded = torch.nn.Sequential(torch.nn.Embedding(vocabulary, dim), torch.nn.Tanh(), torch.nn.Linear(dim, 2)).double()
    one_hot = torch.nn.Sequential(OneHot(vocabulary), torch.nn.Linear(vocabulary, dim, bias=False), torch.nn.Tanh(),
                                  torch.nn.Linear(dim, 2)).double()
    with torch.no_grad():
        one_hot[1].weight.copy_(embedded[0].weight.t())
        one_hot[3].weight.copy_(embedded[2].weight)
        one_hot[3].bias.copy_(embedded[2].bias)
    # Tokens 0..6 only: rows 7 and 8 get no gradient, and keep none.
    batches = [torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    loss = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    kfac_embedded = dkfac.KFACPreconditioner(embedded, kl_clip=None, compute_method=method, inv_dtype=torch.float64)
    kfac_one_hot = dkfac.KFACPreconditioner(one_hot, kl_clip=None, compute_method=method, inv_dtype=torch.float64)
    assert [type(m).__name__ for _, m in kfac_embedded.layers] == ['Embedding', 'Linear']
    want = preconditioned(one_hot, kfac_one_hot, batches, loss)
    got = preconditioned(embedded, kfac_embedded, batches, loss)
    plain = embedded[0].weight.grad
    for step_want, step_got in zip(want, got):
        torch.testing.assert_close(step_got['0.weight'], step_want['1.weight'].t(), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(step_got['2.weight'], step_want['3.weight'], rtol=1e-9, atol=1e-12)
        assert torch.equal(step_got['0.weight'][7:], torch.zeros(2, dim, dtype=torch.float64))
    assert not torch.allclose(got[-1]['0.weight'], plain + 1), 'sanity'
    # The A factor is held as its diagonal: V values, not V^2.
    assert kfac_embedded.state_dict()['layers']['0']['A'].shape == (vocabulary,)


def test_padding_idx_row_is_never_moved():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 3, padding_idx=0), torch.nn.Linear(3, 1))
    kfac = dkfac.KFACPreconditioner(model, kl_clip=None)
    before = model[0].weight[0].clone()
    tokens = torch.tensor([[0, 1, 2, 0], [3, 0, 4, 5]])
    grads = preconditioned(model, kfac, [tokens, tokens.flip(1)], lambda m, x: m(x).pow(2).mean())
    for g in grads:
        assert torch.equal(g['0.weight'][0], torch.zeros(3)), 'the padding row got a gradient'
        assert g['0.weight'][1:].abs().sum() > 0
    assert torch.equal(model[0].weight[0], before)


def test_sparse_embedding_keeps_its_plain_gradient_and_says_why(caplog):
    model = torch.nn.Sequential(torch.nn.Embedding(6, 3, sparse=True), torch.nn.Linear(3, 1))
    with caplog.at_level(logging.INFO, logger='dkfac'):
        with pytest.warns(UserWarning, match=r"layer '0' \(Embedding\) keeps its plain gradient: a sparse Embedding"):
            kfac = dkfac.KFACPreconditioner(model, loglevel=logging.INFO)
    assert [n for n, _ in kfac.layers] == ['1']
    assert "0.weight (a sparse Embedding (sparse=True)" in caplog.text


class TiedLanguageModel(torch.nn.Module):
    def __init__(self, vocabulary: int = 11, dim: int = 4) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocabulary, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocabulary, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2 ties lm_head to wte

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.mix(self.wte(tokens)))))


def test_tied_weights_are_left_to_the_optimizer_naming_both_modules(caplog):
    torch.manual_seed(3)
    model = TiedLanguageModel()
    reference = TiedLanguageModel()
    reference.load_state_dict(model.state_dict())
    with caplog.at_level(logging.INFO, logger='dkfac'), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        kfac = dkfac.KFACPreconditioner(model, loglevel=logging.INFO)
    messages = [str(w.message) for w in caught]
    assert any("layer 'wte' (Embedding) keeps its plain gradient: tied to 'head'" in m for m in messages), messages
    assert any("layer 'head' (Linear) keeps its plain gradient: tied to 'wte'" in m for m in messages), messages
    assert [n for n, _ in kfac.layers] == ['mix']
    # What is left out is listed at the log level given, with the reasons.
    assert "trainable parameters keep their plain gradient" in caplog.text
    assert "norm.weight, norm.bias (LayerNorm is not a layer kind K-FAC preconditions)" in caplog.text
    assert "wte.weight (tied to 'head'" in caplog.text
    tokens = torch.randint(0, 11, (2, 5))
    loss = lambda m, x: torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())  # noqa: E731
    got = preconditioned(model, kfac, [tokens], loss)[0]
    loss(reference, tokens).backward()
    torch.testing.assert_close(got['wte.weight'], reference.wte.weight.grad, rtol=0, atol=0)
    assert not torch.allclose(got['mix.weight'], reference.mix.weight.grad)


def kronecker_solve(a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(A kron G + damping I)^-1 vec(grad), the dense definition of the eigen method (docs/MATH.md 2.1)."""
    k = torch.kron(a, g) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
    v = torch.linalg.solve(k, grad.t().reshape(-1))  # vec stacks columns
    return v.reshape(grad.shape[1], grad.shape[0]).t()


def test_a_factor_wider_than_diagonal_factor_dim_is_its_diagonal():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(12, 3)).double()
    damping = 0.01
    kfac = dkfac.KFACPreconditioner(model, kl_clip=None, damping=damping, factor_decay=0.0, diagonal_factor_dim=10,
                                      inv_dtype=torch.float64)
    seen = {}

    def keep(module, inputs, output):
        seen['x'] = inputs[0].detach()
        output.register_hook(lambda g: seen.__setitem__('g', g.detach()))

    model[0].register_forward_hook(keep)
    x = torch.randn(16, 12, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    grad = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    kfac.step()
    got = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    rows = torch.cat([seen['x'], torch.ones(16, 1, dtype=torch.float64)], 1)
    a = torch.diag((rows * rows).mean(0))  # the A factor's diagonal alone: 13 > diagonal_factor_dim
    g = seen['g'].t() @ seen['g'] / 16
    torch.testing.assert_close(got, kronecker_solve(a, g, grad, damping), rtol=1e-9, atol=1e-12)
    state = kfac.state_dict()
    assert state['layers']['0']['A'].shape == (13,) and state['layers']['0']['G'].shape == (3, 3)
    assert 'a_eigenvectors' not in state['dkfac']['second_order']['0']


def register_by_kind(preconditioner) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for _, module in preconditioner.layers:
        kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + 1
    return kinds


@needs_transformers
def test_gpt2_registers_conv1d_embedding_and_head_in_memory_linear_in_the_vocabulary(caplog):
    import transformers

    torch.manual_seed(5)
    vocabulary, layers = 50257, 2
    config = transformers.GPT2Config(vocab_size=vocabulary, n_positions=32, n_embd=32, n_layer=layers, n_head=2,
                                     tie_word_embeddings=False)
    model = transformers.GPT2LMHeadModel(config)
    with caplog.at_level(logging.INFO, logger='dkfac'):
        kfac = dkfac.KFACPreconditioner(model, loglevel=logging.INFO)
    assert register_by_kind(kfac) == {'Embedding': 2, 'Conv1D': 4 * layers, 'Linear': 1}
    assert 'registered lm_head (Linear): A 32 x 32, G 50257 diagonal' in caplog.text
    assert 'registered transformer.wte (Embedding): A 50257 diagonal, G 32 x 32' in caplog.text
    assert 'LayerNorm is not a layer kind K-FAC preconditions' in caplog.text
    tokens = torch.randint(0, vocabulary, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    kfac.step()
    # Factors, second-order state (the eigen method's [g, a] denominator included) and the batch: for the head
    # and the token embedding, a few copies of their weights, never vocabulary^2 (9.4 GiB).
    vocabulary_weights = 2 * vocabulary * 32 * 4
    assert kfac.memory_usage()['total'] < 2 * vocabulary_weights + 4 * 2**20, kfac.memory_usage()


@needs_transformers
def test_gpt2_and_bert_tied_heads_are_named_and_the_rest_registers():
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=1,
                                                                n_head=2, bos_token_id=0, eos_token_id=0))
    with pytest.warns(UserWarning, match=r"layer 'lm_head' \(Linear\) keeps its plain gradient: tied to "
                                         r"'transformer.wte'"):
        kfac = dkfac.KFACPreconditioner(gpt2)
    assert register_by_kind(kfac) == {'Embedding': 1, 'Conv1D': 4}  # wpe and the block; wte and lm_head are tied
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16))
    with pytest.warns(UserWarning, match=r"layer 'cls.predictions.decoder' \(Linear\) keeps its plain gradient: tied"):
        kfac = dkfac.KFACPreconditioner(bert)
    # position and token-type embeddings; query, key, value, attention output, intermediate, output and the
    # prediction head's transform (BertForMaskedLM has no pooler)
    assert register_by_kind(kfac) == {'Embedding': 2, 'Linear': 7}


def test_kfac_reduce_is_the_dense_solve_of_per_sample_factors():
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).double()
    damping = 0.02
    kfac = dkfac.KFACPreconditioner(model, kl_clip=None, damping=damping, factor_decay=0.0, kfac_approx='reduce',
                                    inv_dtype=torch.float64)
    assert 'K-FAC reduce' in kfac.plan
    seen = {}

    def keep(module, inputs, output):
        seen['x'] = inputs[0].detach()
        output.register_hook(lambda g: seen.__setitem__('g', g.detach()))

    model[0].register_forward_hook(keep)
    x = torch.randn(5, 7, 4, dtype=torch.float64)  # 5 sequences of 7 positions
    model(x).pow(2).sum().backward()
    grad = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    kfac.step()
    got = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1)
    rows = torch.cat([seen['x'].mean(1), torch.ones(5, 1, dtype=torch.float64)], 1)  # one row per sequence
    summed = seen['g'].sum(1)
    a = rows.t() @ rows / 5
    g = summed.t() @ summed / 5
    torch.testing.assert_close(got, kronecker_solve(a, g, grad, damping), rtol=1e-9, atol=1e-12)
    expand = torch.nn.Sequential(torch.nn.Linear(4, 3)).double()
    expand.load_state_dict(model.state_dict())
    assert 'K-FAC reduce' not in dkfac.KFACPreconditioner(expand).plan


def test_factors_that_cannot_fit_in_memory_are_refused_before_any_allocation():
    model = torch.nn.Sequential(torch.nn.Linear(2, 300_000))
    kfac = dkfac.KFACPreconditioner(model)  # G is 300000 wide: kept diagonal by default
    assert kfac.memory_usage()['total'] == 0
    with pytest.raises(RuntimeError, match=r"more than this machine's .* the widest is '0' \(Linear\)'s G factor "
                                           r"300000 x 300000 .*diagonal_factor_dim=8192"):
        dkfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Linear(2, 300_000)), diagonal_factor_dim=0)


def tiny_gpt2(**kwargs):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, **kwargs)
    return transformers.GPT2LMHeadModel(config).train()


def dkfac_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        run()
    return [str(w.message) for w in caught if 'dkfac' in str(w.message)]


@needs_transformers
def test_position_ids_shared_by_the_batch_are_named():
    """GPT-2 gives its position Embedding (wpe) one row of ids, [1, T], for the whole batch and adds the output to
    every example's: the output gradient it sees is the batch's sum, so its G factor is the outer product of sums
    (27.9x the examples' mean at batch 32) and depends on the batch size. Said at the first factor step, naming the
    layer and the fix; ids given per example are not."""
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    for per_example in (False, True):
        model = tiny_gpt2()
        kfac = dkfac.KFACPreconditioner(model)
        position_ids = torch.arange(16).expand(8, -1) if per_example else None

        def step() -> None:
            model(input_ids=tokens, labels=tokens, position_ids=position_ids).loss.backward()
            kfac.step()

        named = [m for m in dkfac_warnings(step) if 'examples: ids shared by the batch' in m]
        if per_example:
            assert named == []
        else:
            assert len(named) == 1 and "'transformer.wpe'" in named[0] and 'where other layers had 8' in named[0]


def test_a_batch_of_one_beside_flattened_tokens_is_not_taken_for_shared_ids():
    """At batch size 1 a mixture of experts' shared expert sees the tokens flattened ([B*T, d]: T rows of one row
    each), which counted as T examples beside the token Embedding's one: it was told its ids were shared by the
    batch, and to leave itself out. Only layers given a batch of sequences count now."""
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(40, 8)
            self.attention, self.expert = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.attention(self.embed(ids))  # [B, T, d]
            return self.expert(h.reshape(-1, 8))  # [B*T, d]

    model = Model()
    kfac = dkfac.KFACPreconditioner(model)

    def step() -> None:
        model(torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(0))).pow(2).mean().backward()
        kfac.step()

    assert [m for m in dkfac_warnings(step) if 'examples: ids shared by the batch' in m] == []


@needs_transformers
@pytest.mark.parametrize('setting', ['bf16-autocast', 'checkpointing'])
def test_freed_inputs_are_not_taken_for_one_tensor(setting):
    """Under CPU bf16 autocast and non-reentrant activation checkpointing the inputs of GPT-2's Conv1D layers are
    freed in the forward pass, and a later layer's input can take the same address: the first factor step suggested
    shared_input_layers for c_attn and c_fc, which read different LayerNorm outputs (and following it was refused).
    Each pass now keeps its storage's identity. The recomputation is not taken for a forward without backward."""
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    model = tiny_gpt2()
    if setting == 'checkpointing':
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    kfac = dkfac.KFACPreconditioner(model, skip_layers=['wpe'])

    def steps() -> None:
        for _ in range(2):
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=setting == 'bf16-autocast'):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            kfac.step()

    assert dkfac_warnings(steps) == []


@needs_transformers
@pytest.mark.parametrize('factor_step', [True, False], ids=['factor-step', 'other-step'])
def test_an_embedding_resized_in_place_is_refused_naming_it(factor_step):
    """resize_token_embeddings keeps the Embedding and its Parameter and assigns a larger .data: the hook's capture
    then failed on the new ids with a bare IndexError, or step() on a shape mismatch naming no layer."""
    model = tiny_gpt2(tie_word_embeddings=False)
    kfac = dkfac.KFACPreconditioner(model, factor_update_steps=1 if factor_step else 5, skip_layers=['wpe'])
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens, labels=tokens).loss.backward()
    kfac.step()
    model.resize_token_embeddings(72)
    model.zero_grad()
    tokens = torch.randint(0, 72, (2, 8), generator=torch.Generator().manual_seed(2))
    message = r"'transformer.wte' \(Embedding\): its weight is \[72, 32\] now, \[64, 32\] when the preconditioner"
    with pytest.raises(ValueError, match=message):
        model(input_ids=tokens, labels=tokens).loss.backward()
        kfac.step()
