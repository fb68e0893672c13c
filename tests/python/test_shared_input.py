"""``shared_input_layers`` (docs/MATH.md section 2.7): layers that read one input tensor (an attention block's query,
key and value) share one A factor and its decomposition. From Python, on a Hugging Face BERT built from a config:
the same gradients as without sharing, bit for bit; the shared state held and saved once; a copy of the input
refused naming both layers; state dicts of either kind load where they can, and are refused naming the option where
they cannot."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import dkfac

needs_transformers = pytest.mark.skipif(importlib.util.find_spec('transformers') is None,
                                        reason='transformers is not installed')
SHARED = '(query|key|value)$'


def bert() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertModel(config, add_pooling_layer=False).double()


def train(model, preconditioner, steps: range) -> list[list[torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 50, (3, 8), generator=generator)
        target = torch.randn(3, 8, 16, generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(input_ids=tokens).last_hidden_state, target).backward()
        preconditioner.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads


@needs_transformers
@pytest.mark.parametrize('options', [{}, {'compute_method': 'inverse'}, {'eigen_adam': True, 'kl_clip': None},
                                     {'inv_update_steps': 2, 'eigh_interval': 2}], ids=['eigen', 'inverse',
                                                                                        'eigen_adam', 'refresh'])
def test_bert_shares_query_key_value_inputs_bit_for_bit(options):
    separate_model, shared_model = bert(), bert()
    separate = dkfac.KFACPreconditioner(separate_model, **options)
    shared = dkfac.KFACPreconditioner(shared_model, shared_input_layers=SHARED, **options)
    assert shared.shared_input_layers == [SHARED]
    expected = train(separate_model, separate, range(4))
    got = train(shared_model, shared, range(4))
    for step, (g, e) in enumerate(zip(got, expected)):
        for k, (a, b) in enumerate(zip(g, e)):
            assert torch.equal(a, b), f'step {step} parameter {k}'
    # Two layers of 3 attention inputs: 4 followers hold no A side; memory_usage counts it once.
    a_bytes = 0
    for name, state in zip(separate._names, separate._core.layer_states()):
        if name.endswith(('key', 'value')):
            a_bytes += sum(t.numel() * t.element_size() for k, t in state.items() if k.startswith('a_'))
    assert a_bytes > 0
    # The layers' own state (the stacks' pads, pad_widths, differ: one group of 3-layer units against one of 6 layers).
    def held(p):
        usage = p.memory_usage()
        return usage['total'] - usage.get('stack_padding', 0)

    assert held(shared) == held(separate) - a_bytes
    assert '4 layer(s) share the A factor' in shared.plan


@needs_transformers
def test_state_dicts_hold_the_shared_factor_once_and_load_where_they_can():
    separate_model, shared_model = bert(), bert()
    separate = dkfac.KFACPreconditioner(separate_model)
    shared = dkfac.KFACPreconditioner(shared_model, shared_input_layers=[SHARED])
    train(separate_model, separate, range(2))
    train(shared_model, shared, range(2))
    state = shared.state_dict()
    key = 'encoder.layer.0.attention.self.key'
    assert set(state['layers'][key]) == {'G'}
    assert set(state['layers']['encoder.layer.0.attention.self.query']) == {'A', 'G'}

    # Without sharing, such a state dict is refused, naming the option; the live state is unchanged.
    other = dkfac.KFACPreconditioner(bert())
    with pytest.raises(ValueError, match='saved with shared_input_layers'):
        other.load_state_dict(state)
    assert other.steps == 0

    # A state dict without sharing loads into a sharing run, which then steps as the separate run does.
    resumed_model = bert()
    resumed_model.load_state_dict(separate_model.state_dict())
    resumed = dkfac.KFACPreconditioner(resumed_model, shared_input_layers=SHARED)
    resumed.load_state_dict(separate.state_dict())
    for g, e in zip(train(resumed_model, resumed, range(2, 4)), train(separate_model, separate, range(2, 4))):
        assert all(torch.equal(a, b) for a, b in zip(g, e))


class Attention(torch.nn.Module):
    """query and key of one input; with `copy_key`, the key is given a copy of it (not the same tensor)."""

    def __init__(self, copy_key: bool = False) -> None:
        super().__init__()
        self.query = torch.nn.Linear(4, 3)
        self.key = torch.nn.Linear(4, 3)
        self.copy_key = copy_key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.query(x) * self.key(x.clone() if self.copy_key else x)


def test_an_input_that_is_not_the_same_tensor_is_refused_naming_both_layers():
    model = Attention(copy_key=True)
    preconditioner = dkfac.KFACPreconditioner(model, shared_input_layers=SHARED)
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'(key|query)' \(Linear\) shares its A factor with '(query|key)' "
                                           r"\(Linear\) but was given another input at pass 1"):
        preconditioner.step()


def test_bad_patterns_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="shared_input_layers pattern 'query' has no capture group"):
        dkfac.KFACPreconditioner(Attention(), shared_input_layers='query')
    with pytest.raises(RuntimeError, match='cannot share an A factor: they have A widths 5 and 4'):
        model = torch.nn.ModuleDict({'a_query': torch.nn.Linear(4, 3), 'b_query': torch.nn.Linear(3, 3)})
        model.forward = lambda x: model['b_query'](model['a_query'](x))
        dkfac.KFACPreconditioner(model, shared_input_layers='^(a|b)_query$')


def test_followers_build_their_g_as_their_leader_does_under_autocast():
    """bfloat16 weights under bfloat16 autocast: every G is built in float32 (the autocast rule), the followers'
    too, though they build no A from the forward that says so."""
    model = Attention().to(torch.bfloat16)
    preconditioner = dkfac.KFACPreconditioner(model, shared_input_layers=SHARED)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = model(torch.randn(5, 4, dtype=torch.bfloat16))
    out.float().sum().backward()
    preconditioner.step()
    query, key = preconditioner._core.layer_states()
    assert query['a_factor'].dtype == query['g_factor'].dtype == key['g_factor'].dtype == torch.float32
    assert 'a_factor' not in key


@needs_transformers
def test_a_bert_without_the_option_is_told_which_patterns_would_share():
    model = bert()
    preconditioner = dkfac.KFACPreconditioner(model)
    with pytest.warns(UserWarning, match=r"2 group\(s\) of layers were given one input tensor at step 0 "
                                         r"\('encoder.layer.0.attention.self.query', "
                                         r"'encoder.layer.0.attention.self.key', 'encoder.layer.0.attention.self.value' "
                                         r"and others\).*shared_input_layers=\['\(query\|key\|value\)\$'\]") as record:
        train(model, preconditioner, range(2))
    assert sum('given one input tensor' in str(w.message) for w in record) == 1  # once


class _TwoReaders(torch.nn.Module):
    """Two Linears given one input (a shared-input group) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.head = torch.nn.Linear(4, 5), torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.q(x)) * self.k(x))


@pytest.mark.parametrize('fold_in_hooks', [True, False], ids=['hooks', 'step'])
def test_a_step_whose_gradients_are_not_finite_keeps_the_shared_factor_as_separate_ones(fold_in_hooks):
    """A step whose G batches are not finite (a loss scale's overflow) keeps each layer's factors; a group's shared A
    used to be folded anyway, from its finite A batch (28% off the run without the option, then the parameters 1e-2
    apart). Equal bit for bit to separate factors, at the guarded step and after, in the hooks and at step()."""
    runs = []
    for shared in (False, True):
        model = _TwoReaders()
        preconditioner = dkfac.KFACPreconditioner(
            model, factor_update_steps=1, inv_update_steps=2, damping=0.003, factor_decay=0.5,
            fold_in_hooks=fold_in_hooks, shared_input_layers=['^(q|k)$'] if shared else [])
        steps = []
        for step in range(5):
            model.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            (model(x).pow(2).mean() * (float('inf') if step == 2 else 1.0)).backward()
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')  # the guard's warning at step 2
                preconditioner.step()
            grads = [p.grad.clone() for p in model.parameters()]
            if all(torch.isfinite(g).all() for g in grads):  # as a scaler skips the step
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            state = preconditioner.state_dict()['layers']  # the group's A is the leader's, q's
            factors = [state['q']['A'].clone(), state['q']['G'].clone(), state['k']['G'].clone()]
            steps.append((grads, factors))
        runs.append(steps)
    for step, (separate, shared) in enumerate(zip(*runs)):
        for a, b in zip(separate[0] + separate[1], shared[0] + shared[1]):  # the guarded step's NaN and Inf alike
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f'step {step}')
