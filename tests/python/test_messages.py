"""What the Python front end says: the C++ core's warnings go through Python's warnings module (attributed
to the caller's line), name KFACPreconditioner's keyword arguments and each module's own torch.nn class."""

from __future__ import annotations

import inspect
import logging
import pydoc
import warnings

import pytest
import torch

import dkfac
from dkfac import _C


def tiny_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


class Attention(torch.nn.Module):
    """A projection of torch's NonDynamicallyQuantizableLinear class (torch.nn.MultiheadAttention's out_proj) that
    the forward uses through its weight, as MultiheadAttention does: the out_proj module itself does not run.
    (A MultiheadAttention's own out_proj is set aside at construction: test_reliability.py.)"""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.Module()
        self.attn.out_proj = torch.nn.modules.linear.NonDynamicallyQuantizableLinear(8, 8)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = torch.nn.functional.linear(x, self.attn.out_proj.weight, self.attn.out_proj.bias)
        return self.head(projected[..., :4])


def nan_step(model: torch.nn.Module, preconditioner: dkfac.KFACPreconditioner) -> None:
    model(torch.full((2, 4), float('nan'))).sum().backward()
    preconditioner.step()


def test_core_warnings_are_python_warnings_from_the_callers_line():
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        model(torch.full((2, 4), float('nan'))).sum().backward()
        p.step()  # the line the warnings must point at
        line = inspect.currentframe().f_lineno - 1
        model(torch.full((2, 4), float('nan'))).sum().backward()
        p.step()  # once per layer: nothing new
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"dkfac: layer '{name}' (Linear), step 0: captured factors contain NaN or Inf; factors not updated and the "
        'plain gradient is kept for this step (warned once per layer)' for name in ('0', '2')
    ], messages
    assert all(w.category is UserWarning and w.filename == __file__ and w.lineno == line for w in caught)


def test_core_warnings_obey_warning_filters():
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(UserWarning, match=r"layer '2' \(Linear\) has a factor wider than large_factor_dim=6"):
            dkfac.KFACPreconditioner(tiny_mlp(), large_factor_dim=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        warnings.filterwarnings('ignore', message='dkfac: layer .* NaN')
        model = tiny_mlp()
        nan_step(model, dkfac.KFACPreconditioner(model))
    assert caught == []


def test_core_warnings_do_not_reach_stderr(capfd):
    model = tiny_mlp()
    with pytest.warns(UserWarning, match='captured factors contain NaN or Inf'):
        nan_step(model, dkfac.KFACPreconditioner(model))
    assert capfd.readouterr().err == ''


def test_an_error_in_the_core_wins_over_its_warnings():
    # The NaN factors are warned about before the second-order update reads the bad damping and fails.
    model = tiny_mlp()
    with pytest.warns(UserWarning, match='captured factors contain NaN'):
        with pytest.raises(RuntimeError, match='damping must be finite and > 0, got -1 at step 0'):
            nan_step(model, dkfac.KFACPreconditioner(model, damping=lambda step: -1.0))
    model = tiny_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(RuntimeError, match='damping must be finite and > 0, got -1 at step 0'):
            nan_step(model, dkfac.KFACPreconditioner(model, damping=lambda step: -1.0))


def test_large_factor_warning_names_the_keyword_argument():
    with pytest.warns(UserWarning) as caught:
        dkfac.KFACPreconditioner(tiny_mlp(), large_factor_dim=5)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    for message, layer in zip(messages, ("'0' (Linear)", "'2' (Linear)")):
        assert message.startswith(f'dkfac: layer {layer} has a factor wider than large_factor_dim=5: '), message
    assert 'G factor 6 x 6' in messages[0] and 'A factor 7 x 7' in messages[1]
    assert not any('Options::' in m for m in messages), messages


def test_keywords_and_defaults_are_the_cores_declaration():
    # KFACPreconditioner's keywords are the core's option table (dkfac/options.h): each option by its kfac_pytorch
    # name where it has one, with the core's default, or kfac_pytorch's where that differs; dkfac's own name of
    # such an option is a keyword too (default None: not given).
    parameters = inspect.signature(dkfac.KFACPreconditioner).parameters
    table = {o['alias'] or o['name']: o for o in _C.option_table()}
    dkfac_names = {o['name'] for o in _C.option_table() if o['alias']}
    assert dkfac_names == {'symmetric_comm', 'balance'}
    assert set(table) <= set(parameters)
    assert set(parameters) - set(table) == {'model', 'grad_scaler', 'loglevel', 'process_group', 'timeout',
                                             'model_parallel_group', 'tensor_parallel_factors'} | dkfac_names
    for name, option in table.items():
        assert parameters[name].default == dkfac.preconditioner._python_default(option), name
    assert all(parameters[name].default is None for name in dkfac_names)
    assert parameters['large_factor_dim'].default == int(table['large_factor_dim']['default']) == 4096
    assert parameters['symmetry_aware'].default is False and table['symmetry_aware']['name'] == 'symmetric_comm'
    assert parameters['inv_dtype'].default == torch.float32 and table['inv_dtype']['default'] == 'none'
    assert parameters['spd_fusion'].default == [] and parameters['spd_profile_steps'].default == 3
    assert 'large_factor_dim' in (dkfac.KFACPreconditioner.__doc__ or '')


def test_keywords_are_explicit_in_the_signature():
    # Written in __init__'s def (what IDEs and type checkers read), not set at run time, and shown by help().
    init = dkfac.KFACPreconditioner.__init__
    code = inspect.unwrap(init).__code__
    keywords = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    assert set(keywords) == set(inspect.signature(dkfac.KFACPreconditioner).parameters) - {'model'}
    assert not code.co_flags & inspect.CO_VARKEYWORDS, 'no **kwargs'
    assert '__signature__' not in vars(init)
    assert inspect.signature(init).parameters['damping'].annotation == 'Callable[[int], float] | float'
    text = pydoc.render_doc(dkfac.KFACPreconditioner)
    assert 'grad_worker_fraction: ' in text and 'spd_fusion: ' in text and 'damping: ' in text


def test_dkfac_and_kfac_pytorch_names_of_one_option_are_given_once():
    assert dkfac.KFACPreconditioner(tiny_mlp(), symmetric_comm=True).symmetry_aware is True
    assert dkfac.KFACPreconditioner(tiny_mlp(), balance='memory').assignment_strategy == 'memory'
    with pytest.raises(TypeError, match='symmetry_aware and symmetric_comm name one option; give one'):
        dkfac.KFACPreconditioner(tiny_mlp(), symmetry_aware=True, symmetric_comm=False)


def test_large_factor_dim_default_is_the_cores():
    with pytest.warns(UserWarning, match=r"layer '0' \(Linear\) has a factor wider than large_factor_dim=4096: "
                                         r'A factor 4097 x 4097'):
        dkfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Linear(4096, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        dkfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Linear(4095, 2)))  # A is 4096 x 4096: not wider
        dkfac.KFACPreconditioner(torch.nn.Sequential(torch.nn.Linear(4096, 2)), large_factor_dim=0)


def test_messages_name_the_modules_own_class():
    model = Attention()
    assert type(model.attn.out_proj).__name__ == 'NonDynamicallyQuantizableLinear'
    with pytest.warns(UserWarning, match=r"layer 'attn\.out_proj' \(NonDynamicallyQuantizableLinear\) has a factor "
                                         'wider than large_factor_dim=8'):
        p = dkfac.KFACPreconditioner(model, large_factor_dim=8)
    model(torch.randn(3, 2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match=r"K-FAC layer 'attn\.out_proj' \(NonDynamicallyQuantizableLinear\) has a "
                                           "gradient, but its module's hooks saw no forward and backward pass"):
        p.step()

    model = Attention()
    p = dkfac.KFACPreconditioner(model, unused_layer_policy='skip')
    model(torch.randn(3, 2, 8)).sum().backward()
    with pytest.warns(UserWarning, match=r"layer 'attn\.out_proj' \(NonDynamicallyQuantizableLinear\), step 0: has a "
                                         'gradient, but its module'):
        p.step()


def test_python_messages_name_the_modules_own_class(caplog):
    with caplog.at_level(logging.INFO, logger='dkfac'):
        with pytest.warns(UserWarning, match=r"matches no layer.*'attn\.out_proj' \(NonDynamicallyQuantizableLinear\), "
                                             r"'head' \(Linear\)"):
            dkfac.KFACPreconditioner(Attention(), skip_layers=['^conv'], loglevel=logging.INFO)
    assert 'registered attn.out_proj (NonDynamicallyQuantizableLinear): A 9 x 9, G 8 x 8' in caplog.text


def test_layer_discovery_is_the_cores_and_says_what_the_cpp_front_end_says():
    # The same structure as tests/layers/discovery_test.cpp's: the same warnings, word for word.
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(8, 8, 3)
            self.depthwise = torch.nn.Conv2d(8, 8, 3, groups=8)
            self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
            self.head = torch.nn.Linear(4, 2)

    with pytest.warns(UserWarning) as caught:
        p = dkfac.KFACPreconditioner(Net(), skip_layers=['Embedding'])
    assert [name for name, _ in p.layers] == ['stem', 'head']
    messages = [str(w.message) for w in caught]
    assert "dkfac: layer 'depthwise' is a grouped Conv2d (groups=8); it keeps its plain gradient" in messages
    assert ("dkfac: skip_layers pattern 'Embedding' matches no layer, so it skips nothing; patterns are searched "
            "(ECMAScript regular expressions) in these layer names, kinds and classes: 'stem' (Conv2d), "
            "'head' (Linear)") in messages
    with pytest.raises(ValueError, match='found no Linear, Conv2d or Embedding layer to precondition in Net'):
        dkfac.KFACPreconditioner(Net(), skip_layers=['.'])


def test_hyper_parameters_given_as_tensors_or_numpy_scalars_are_numbers_and_strings_are_refused():
    """A one-element tensor or a numpy scalar is the number it holds, at construction and through the setters, as a
    callable's result is (they were refused as 'must be a number, got true'); a string is refused naming the option
    (damping='0.01' was parsed, factor_update_steps='10' failed inside pybind without naming it)."""
    import numpy as np
    model = torch.nn.Linear(3, 2)
    given = dkfac.KFACPreconditioner(model, lr=torch.tensor(0.5), damping=np.float64(0.02),
                                     factor_update_steps=np.int64(3), adam_eps=np.float32(0.5))
    assert (given.lr, given.damping, given.factor_update_steps) == (0.5, 0.02, 3)
    assert isinstance(given.factor_update_steps, int)
    given.damping = torch.tensor(0.25, dtype=torch.float64)
    assert given.damping == 0.25 and isinstance(given.damping, float)
    for keyword in ('damping', 'factor_update_steps', 'kl_clip', 'lr'):
        with pytest.raises(TypeError, match=f"{keyword} must be a number or a callable of the step, got the string"):
            dkfac.KFACPreconditioner(torch.nn.Linear(3, 2), **{keyword: '1'})
    with pytest.raises(TypeError, match="damping must be a number or a callable of the step, got the string"):
        given.damping = '0.1'
    with pytest.raises(TypeError, match=r'damping must be a number, got a tensor of shape \[2\]'):
        dkfac.KFACPreconditioner(torch.nn.Linear(3, 2), damping=torch.tensor([0.1, 0.2]))
