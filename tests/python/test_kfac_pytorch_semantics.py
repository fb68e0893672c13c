"""dkfac's Python front end against kfac_pytorch v0.4.2 on stock torch.nn models.

Golden values come from tests/python/make_golden.py run on kfac_pytorch's source; with KFAC_PYTORCH_SRC
pointing at such a tree, the live tests also run kfac_pytorch side by side.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import sys

import pytest
import torch

import dkfac
import scenarios

# Our own file (it holds torch.__version__, which torch >= 2.6's weights_only loading refuses).
GOLDEN = torch.load(os.path.join(os.path.dirname(__file__), 'data', 'kfac_pytorch_golden.pt'), weights_only=False)
# float32 round-off through eigendecompositions and a few SGD steps
RTOL, ATOL = 2e-4, 2e-6


def assert_close(actual, expected, what):
    for step, (a_step, e_step) in enumerate(zip(actual, expected)):
        for i, (a, e) in enumerate(zip(a_step, e_step)):
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f'{what}, step {step}, param {i}: {m}')


@pytest.mark.parametrize('name', sorted(scenarios.SCENARIOS))
def test_matches_kfac_pytorch_golden(name):
    result = scenarios.run(dkfac, name)
    golden = GOLDEN['scenarios'][name]
    assert len(result['grads']) == len(golden['grads'])
    assert_close(result['grads'], golden['grads'], name)
    assert_close([result['params']], [golden['params']], f'{name} final parameters')


def test_skip_layers_leave_plain_gradients():
    kind, kwargs, _, _ = scenarios.SCENARIOS['cnn_skip_layers']  # skip_layers=['^1$', 'Linear']
    model = scenarios.make_model(kind)
    preconditioner = dkfac.KFACPreconditioner(model, **kwargs)
    assert [name for name, _ in preconditioner.layers] == ['0', '2']  # '1' is a ReLU; the Linear '5' by class
    x, y = scenarios.batch(kind, 0)
    scenarios.loss_of(kind, model(x), y).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    preconditioner.step()
    after = [p.grad for p in model.parameters()]  # conv0 w, b; conv2 w; linear w, b
    assert not torch.equal(after[0], plain[0]) and not torch.equal(after[2], plain[2])
    assert torch.equal(after[3], plain[3]) and torch.equal(after[4], plain[4])


def test_migrates_from_a_kfac_pytorch_state_dict():
    migration = GOLDEN['migration']
    model = scenarios.make_model('cnn')
    with torch.no_grad():
        for p, saved in zip(model.parameters(), migration['params']):
            p.copy_(saved)
    result = scenarios.run(dkfac, 'cnn_eigen', steps=3, model=model, state=migration['state'], start=3)
    assert_close(result['grads'], migration['grads'], 'after loading kfac_pytorch state')


def kfac_pytorch():
    src = os.environ.get('KFAC_PYTORCH_SRC')
    if not src:
        pytest.skip('KFAC_PYTORCH_SRC is not set: the live comparison needs a kfac_pytorch v0.4.2 source tree')
    sys.path.insert(0, src)
    try:
        return importlib.import_module('kfac')
    except ImportError as e:
        pytest.skip(f'kfac_pytorch at {src} does not import: {e}')


@pytest.mark.parametrize('name', ['cnn_eigen', 'cnn_inverse', 'mlp3d_eigen'])
def test_matches_live_kfac_pytorch(name):
    kfac = kfac_pytorch()
    expected = scenarios.run(kfac, name)
    actual = scenarios.run(dkfac, name)
    assert_close(actual['grads'], expected['grads'], name)


def test_dkfac_state_dict_loads_into_kfac_pytorch():
    kfac = kfac_pytorch()
    first = scenarios.run(dkfac, 'cnn_eigen', steps=3)
    state = copy.deepcopy(first['state'])
    model = first['model']
    reference = kfac.preconditioner.KFACPreconditioner(model, **scenarios.SCENARIOS['cnn_eigen'][1])
    reference.load_state_dict(state)
    for (name, layer), (_, module) in zip(sorted(reference._layers.values()), sorted(first['state']['layers'].items())):
        torch.testing.assert_close(layer.a_factor, module['A'])


def test_base_preconditioner_has_kfac_pytorchs_api():
    kfac = kfac_pytorch()
    theirs = {n for n in dir(kfac.base_preconditioner.BaseKFACPreconditioner) if not n.startswith('_')}
    ours = set(dir(dkfac.base_preconditioner.BaseKFACPreconditioner))
    assert theirs <= ours, f'missing: {sorted(theirs - ours)}'
    assert issubclass(dkfac.preconditioner.KFACPreconditioner, dkfac.base_preconditioner.BaseKFACPreconditioner)


def test_repr_has_kfac_pytorchs_fields_and_values():
    kfac = kfac_pytorch()

    def fields(preconditioner):
        return dict(re.findall(r'^  (\w+)=(.*),$', repr(preconditioner), re.MULTILINE))

    kind, kwargs, _, _ = scenarios.SCENARIOS['cnn_eigen']
    model = scenarios.make_model(kind)
    theirs = fields(kfac.preconditioner.KFACPreconditioner(copy.deepcopy(model), **kwargs))
    ours = fields(dkfac.KFACPreconditioner(model, **kwargs))
    assert set(theirs) <= set(ours), f'missing: {sorted(set(theirs) - set(ours))}'
    # The work assignment: kfac_pytorch names its class (KAISAAssignment), dkfac the system that places the work.
    assert (theirs.pop('assignment'), ours['assignment']) == ('KAISAAssignment', 'KAISA')
    assert {k: ours[k] for k in theirs} == theirs

