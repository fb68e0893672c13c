"""The Python front end's own behaviour: arguments, layer registration on stock and torchvision models,
Conv2d geometry against a dense reference, dtypes, the grad scaler, state dicts and bookkeeping."""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
import typing
import warnings

import pytest
import torch

import dkfac


def tiny_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def train(model, preconditioner, steps, *, scale=1.0, start=0, size=(8, 4)):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(*size, generator=g)
        optimizer.zero_grad()
        (model(x).pow(2).mean() * scale).backward()
        if scale != 1.0:
            for p in model.parameters():
                p.grad.div_(scale)  # what GradScaler.unscale_ does before the preconditioner runs
        preconditioner.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads


@pytest.mark.parametrize('kwargs,message', [
    (dict(damping=0), 'damping must be finite and > 0, got 0'),
    (dict(damping='x'), "damping must be a number or a callable of the step, got the string 'x'"),
    (dict(factor_decay=1.5), r'factor_decay must be finite and in \[0, 1\], got 1.5'),
    (dict(factor_update_steps=0), 'factor_update_steps must be >= 1, got 0'),
    (dict(accumulation_steps=0), 'accumulation_steps must be >= 1, got 0'),
    (dict(allreduce_bucket_cap_mb=-1), 'allreduce_bucket_cap_mb must be finite and >= 0, got -1'),
    (dict(compute_method='svd'), "compute_method must be one of eigen, inverse, got 'svd'"),
    (dict(assignment_strategy='time'), "assignment_strategy must be one of compute, memory, got 'time'"),
    (dict(colocate_factors=False), 'colocate_factors must be True to use compute_eigenvalue_outer_product'),
    (dict(grad_worker_fraction=1.5), r'grad_worker_fraction must be finite and in \[0, 1\], got 1.5'),
    (dict(strategy='horovod'), "strategy must be one of kaisa, spd, dp, auto, got 'horovod'"),
    (dict(unused_layer_policy='ignore'), "unused_layer_policy must be one of error, skip, got 'ignore'"),
    (dict(pi_damping=True), 'pi_damping applies to the inverse compute_method only, got compute_method=eigen'),
    (dict(factor_dtype=torch.int32), "factor_dtype must be one of float32, float64, bfloat16, float16 or none \\(the default\\), got 'int32'"),
    (dict(skip_layers=['(']), "skip_layers pattern '\\(' is not a valid regular expression"),
    (dict(skip_layers=['.*']), 'found no Linear, Conv2d or Embedding layer to precondition in Sequential'),
    (dict(large_factor_dim=-1), r'large_factor_dim must be >= 0, got -1'),
    (dict(large_factor_dim=2.5), r'large_factor_dim must be an integer, got 2.5'),
    (dict(spd_profile_steps=0), r'spd_profile_steps must be >= 1, got 0'),  # SPD-KFAC's options reach Python too
    (dict(spd_fusion=[2, 0]), r'spd_fusion entries must be >= 1, got 0'),
    (dict(symmetric_comm='yes'), "symmetric_comm must be true or false, got 'yes'"),
    (dict(memory_budget=-1), 'memory_budget must be >= 0, got -1'),
    (dict(memory_budget=1 << 20), r'memory_budget applies to strategy auto only \(kaisa places its own work\)'),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        dkfac.KFACPreconditioner(tiny_mlp(), **kwargs)


def test_unknown_argument_is_named():
    with pytest.raises(TypeError, match="unexpected keyword argument 'dampening'; its keywords are .*damping"):
        dkfac.KFACPreconditioner(tiny_mlp(), dampening=0.1)


def test_grad_scaler_type_is_checked():
    with pytest.raises(TypeError, match='grad_scaler must have get_scale'):
        dkfac.KFACPreconditioner(tiny_mlp(), grad_scaler=3.0)


def test_storage_dtypes_that_are_not_floats_of_16_bits_or_more_are_refused():
    with pytest.raises(ValueError, match="factor_dtype must be one of float32, float64, bfloat16, float16 or none"):
        dkfac.KFACPreconditioner(tiny_mlp(), factor_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="inv_dtype must be one of float32, float64, bfloat16, float16 or none"):
        dkfac.KFACPreconditioner(tiny_mlp(), inv_dtype=torch.int32)


def test_bad_schedule_value_names_the_option_and_step():
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model, damping=lambda step: -1.0)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match='damping must be finite and > 0, got -1 at step 0'):
        p.step()


def test_grad_scaler_unscales_g():
    class Scaler:
        def get_scale(self):
            return 1024.0

    model = tiny_mlp()
    plain_model = copy.deepcopy(model)
    plain = train(plain_model, dkfac.KFACPreconditioner(plain_model, inv_update_steps=2), 4)
    scaled_model = copy.deepcopy(model)
    scaled = train(scaled_model, dkfac.KFACPreconditioner(scaled_model, inv_update_steps=2, grad_scaler=Scaler()), 4,
                   scale=1024.0)
    for a_step, b_step in zip(plain, scaled):
        for a, b in zip(a_step, b_step):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # Without the scaler, G would be 1024^2 too large and the preconditioned gradient different.
    wrong_model = copy.deepcopy(model)
    wrong = train(wrong_model, dkfac.KFACPreconditioner(wrong_model, inv_update_steps=2, kl_clip=0), 1, scale=1024.0)
    assert not torch.allclose(wrong[0][0], plain[0][0], rtol=1e-2)


def test_autocast_with_the_real_grad_scaler_divides_g():
    """torch.amp.GradScaler under bfloat16 autocast (CPU): the scaler's own scale tensor divides G, so the factors
    equal an unscaled run's (a power-of-two scale is exact), and a bad scale from a callable is an error."""
    def layers(scaler):
        torch.manual_seed(0)
        model = tiny_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        preconditioner = dkfac.KFACPreconditioner(model, grad_scaler=scaler)
        x, y = torch.randn(8, 4), torch.randn(8, 3)
        for _ in range(2):
            optimizer.zero_grad()
            with torch.autocast('cpu', dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            preconditioner.step()
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        return preconditioner.state_dict()['layers']

    plain = layers(None)
    scaled = layers(torch.amp.GradScaler('cpu', init_scale=2.0 ** 10))
    for name in plain:
        assert torch.equal(scaled[name]['A'], plain[name]['A']), name
        torch.testing.assert_close(scaled[name]['G'], plain[name]['G'], rtol=1e-6, atol=0)
    model = tiny_mlp()
    preconditioner = dkfac.KFACPreconditioner(model, grad_scaler=lambda: float('nan'))
    with pytest.raises(ValueError, match='grad scaler returned nan; the loss scale must be a positive finite number'):
        model(torch.randn(2, 4)).sum().backward()


def factors_under_autocast(device: str, dtype: torch.dtype, scale: float = 1.0,
                           loss_scale: float | None = None) -> tuple[dict, dict]:
    """One step of a small conv net whose forward runs under torch.autocast(device, dtype), inputs times `scale`:
    the factors dkfac built, and those a second preconditioner builds, outside autocast, from the same inputs and
    output gradients as the first saw them (recorded by hooks, then fed to its captures in float32). With
    `loss_scale`, a torch.amp.GradScaler of that scale scales the loss and the reference divides its gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 7 * 7, 10)).to(device)
    twin = copy.deepcopy(model)
    scaler = torch.amp.GradScaler(device, init_scale=loss_scale) if loss_scale else None
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, grad_scaler=scaler)
    seen: dict[str, list] = {}
    for module, (name, _) in preconditioner._layers.items():
        def record(m, inputs, output, name=name):
            seen[name] = [inputs[0].detach().clone(), None]
            output.register_hook(lambda g: seen[name].__setitem__(1, g.detach().clone()))
        module.register_forward_hook(record)
    x = scale * torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.autocast(device, dtype=dtype):
        out = model(x)
    assert out.dtype == dtype, 'the model did run under autocast'
    loss = out.float().pow(2).mean()
    (scaler.scale(loss) if scaler else loss).backward()
    preconditioner.step()
    reference = dkfac.KFACPreconditioner(twin, factor_update_steps=1, inv_update_steps=1)
    for module, (name, capture) in reference._layers.items():
        capture.capture_input(seen[name][0].float())
        capture.capture_output_grad(seen[name][1].float() / (loss_scale or 1.0))
    for p in twin.parameters():
        p.grad = torch.zeros_like(p)
    reference.step()
    return preconditioner.state_dict()['layers'], reference.state_dict()['layers']


@pytest.mark.parametrize('dtype,scale', [(torch.bfloat16, 1.0), (torch.float16, 8.0)], ids=['bfloat16', 'float16-overflow'])
def test_factors_under_autocast_equal_float32_factors_of_the_same_inputs(dtype, scale):
    """Capture leaves the autocast region: the factors are float32 products of what the layers saw, not products
    in the region's dtype (kfac_pytorch v0.4.2's; in float16 the first convolution's sums over 4096 rows of inputs
    scaled by 8 pass 65504 and become inf)."""
    got, expected = factors_under_autocast('cpu', dtype, scale)
    assert got.keys() == expected.keys() and len(got) == 3
    for name in expected:
        for factor in 'AG':
            a, b = got[name][factor], expected[name][factor]
            assert a.dtype == torch.float32, (name, factor, a.dtype)
            assert torch.isfinite(a).all(), (name, factor)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=f'{name} {factor}')


def test_float16_storage_on_cpu():
    model = tiny_mlp()
    reference_model = copy.deepcopy(model)
    half = train(model, dkfac.KFACPreconditioner(model, factor_dtype=torch.float16, inv_dtype=torch.float16), 3)
    full = train(reference_model, dkfac.KFACPreconditioner(reference_model), 3)
    assert all(torch.isfinite(g).all() for step in half for g in step)
    for a, b in zip(half[-1], full[-1]):
        assert (a - b).norm() <= 2e-2 * b.norm(), 'float16 storage is float32 K-FAC to float16 round-off'


def test_state_dict_round_trip_is_exact():
    model = tiny_mlp()
    kwargs = dict(factor_update_steps=2, inv_update_steps=3)
    straight_model = copy.deepcopy(model)
    straight = train(straight_model, dkfac.KFACPreconditioner(straight_model, **kwargs), 7)
    first = copy.deepcopy(model)
    p = dkfac.KFACPreconditioner(first, **kwargs)
    train(first, p, 4)
    saved = copy.deepcopy(p.state_dict())
    assert saved['steps'] == 4 and set(saved['layers']) == {'0', '2'}
    resumed_model = copy.deepcopy(first)
    resumed = dkfac.KFACPreconditioner(resumed_model, **kwargs)
    resumed.load_state_dict(saved)
    assert resumed.steps == 4
    rest = train(resumed_model, resumed, 3, start=4)
    for a_step, b_step in zip(straight[4:], rest):
        for a, b in zip(a_step, b_step):
            assert torch.equal(a, b)


def test_state_dict_errors_name_the_problem():
    p = dkfac.KFACPreconditioner(tiny_mlp())
    with pytest.raises(KeyError, match="no 'steps' entry"):
        p.load_state_dict({})
    with pytest.raises(ValueError, match='does not register'):
        p.load_state_dict({'steps': 0, 'layers': {'0': {'A': None, 'G': None}, 'x': {'A': None, 'G': None}}})
    with pytest.raises(RuntimeError, match="layer '0': A factor has shape"):
        p.load_state_dict({'steps': 0, 'layers': {'0': {'A': torch.eye(3), 'G': None}, '2': {'A': None, 'G': None}}})
    state = p.state_dict()
    state['dkfac']['format_version'] = 1  # what no release wrote: one format is read, another is named
    with pytest.raises(ValueError, match='dkfac state format 1 is not 2, the one this version writes and reads'):
        p.load_state_dict(state)
    assert p.steps == 0


def test_memory_usage_and_reset_batch():
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model)
    assert p.memory_usage()['total'] == 0
    model(torch.ones(2, 4)).sum().backward()
    assert p.memory_usage()['a_batch'] == 4 * (25 + 49) and p.memory_usage()['g_batch'] == 4 * (36 + 9)
    p.reset_batch()
    assert p.memory_usage()['a_batch'] == 0
    model(torch.ones(2, 4)).sum().backward()
    p.step()
    usage = p.memory_usage()
    assert usage['a_factors'] == 4 * (25 + 49) and usage['g_factors'] == 4 * (36 + 9)
    assert usage['total'] == sum(v for k, v in usage.items() if k != 'total') > 0


def test_float64_second_order_on_a_float32_model():
    model = tiny_mlp()
    m32 = copy.deepcopy(model)
    p32 = train(m32, dkfac.KFACPreconditioner(m32), 1)
    m = copy.deepcopy(model)
    p = dkfac.KFACPreconditioner(m, factor_dtype=torch.float64, inv_dtype=torch.float64)
    p64 = train(m, p, 1)
    states = p._core.layer_states()
    assert states[0]['a_factor'].dtype == torch.float64 and states[0]['a_eigenvectors'].dtype == torch.float64
    assert all(g.dtype == torch.float32 for g in p64[0]), 'gradients keep the parameters\' dtype'
    for a, b in zip(p32[0], p64[0]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_bfloat16_factors_halve_factor_memory():
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model, factor_dtype=torch.bfloat16, inv_dtype=torch.bfloat16)
    train(model, p, 2)
    usage = p.memory_usage()
    assert usage['a_factors'] == 2 * (25 + 49) and usage['a_inverses'] > 0
    assert all(torch.isfinite(q.grad).all() for q in model.parameters())


def dense_conv_a_factor(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A = cov([patches, 1] / S) with patches taken by F.unfold from the input as the layer pads it."""
    if conv.padding_mode != 'zeros':
        x = torch.nn.functional.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        padding = 0
    elif conv.padding == 'same':
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        x = torch.nn.functional.pad(x, (total[1] // 2, total[1] - total[1] // 2, total[0] // 2, total[0] - total[0] // 2))
        padding = 0
    elif conv.padding == 'valid':
        padding = 0
    else:
        padding = conv.padding
    cols = torch.nn.functional.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)
    rows = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    if conv.bias is not None:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
    spatial = cols.shape[2]
    rows = rows / spatial
    return rows.t() @ rows / rows.shape[0]


@pytest.mark.parametrize('options', [
    dict(padding=1), dict(padding='same', dilation=2), dict(padding='valid', stride=2), dict(padding=(2, 1),
         padding_mode='reflect'), dict(padding=1, padding_mode='circular', bias=False), dict(padding=1, padding_mode='replicate',
         stride=(2, 1)), dict(kernel_size=(3, 2), padding='same', dilation=(1, 2)),
])
def test_conv2d_factors_match_a_dense_unfold_reference(options):
    options = dict(options)
    kernel = options.pop('kernel_size', 3)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, kernel, **options).double()
    model = torch.nn.Sequential(conv)
    p = dkfac.KFACPreconditioner(model, factor_decay=0.0, inv_dtype=torch.float64)
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    p.step()
    a_factor = p._core.layer_states()[0]['a_factor']
    torch.testing.assert_close(a_factor, dense_conv_a_factor(conv, x), rtol=1e-10, atol=1e-12)


def test_grouped_conv_keeps_its_plain_gradient_with_a_warning():
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, groups=2), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="layer '0' is a grouped Conv2d"):
        p = dkfac.KFACPreconditioner(model)
    assert [name for name, _ in p.layers] == ['2']


def test_skip_layers_pattern_that_matches_nothing_is_warned():
    with pytest.warns(UserWarning, match=r"skip_layers pattern 'Conv2d' matches no layer.*'0' \(Linear\), '2' \(Linear\)"):
        p = dkfac.KFACPreconditioner(tiny_mlp(), skip_layers=['Conv2d', '^2$'])
    assert [name for name, _ in p.layers] == ['0']


def test_torchvision_resnet_layers_and_a_step():
    torchvision = pytest.importorskip('torchvision')
    model = torchvision.models.resnet18(num_classes=10)
    # Keep the factors small enough for a unit test: the widest layers are skipped by name.
    p = dkfac.KFACPreconditioner(model, skip_layers=[r'^layer[34]\.'], compute_method='inverse')
    names = [name for name, _ in p.layers]
    assert names[:3] == ['conv1', 'layer1.0.conv1', 'layer1.0.conv2'] and names[-1] == 'fc'
    assert 'layer2.0.downsample.0' in names and not any(n.startswith('layer3') for n in names)
    x = torch.randn(2, 3, 32, 32)
    torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 2])).backward()
    before = model.conv1.weight.grad.clone()
    p.step()
    assert not torch.equal(model.conv1.weight.grad, before)
    assert torch.equal(model.layer3[0].conv1.weight.grad, model.layer3[0].conv1.weight.grad)


def test_nothing_is_captured_in_eval_or_no_grad():
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model)
    with torch.no_grad():
        model(torch.ones(2, 4))
    model.eval()
    model(torch.ones(2, 4)).sum().backward()
    assert p.memory_usage()['a_batch'] == 0
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        model(torch.ones(2, 4)).sum().backward()
    assert p.memory_usage()['a_batch'] > 0


def test_unused_layer_error_names_it():
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model)
    model[0](torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="K-FAC layer '2' \\(Linear\\) did not run forward/backward"):
        p.step()


def test_a_layer_frozen_after_registration_is_named_frozen():
    """Frozen after the preconditioner was built (fine-tuning that freezes a layer): step() says so, not that
    the layer did not run; with unused_layer_policy='skip' the others are preconditioned and it is left alone."""
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model)
    model[0].requires_grad_(False)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"K-FAC layer '0' \(Linear\) is frozen \(its weight has requires_grad=False\)"):
        p.step()
    model = tiny_mlp()
    p = dkfac.KFACPreconditioner(model, unused_layer_policy='skip')
    model[0].requires_grad_(False)
    model(torch.ones(2, 4)).sum().backward()
    plain = model[2].weight.grad.clone()
    with pytest.warns(UserWarning, match=r"layer '0' \(Linear\), step 0: is frozen .*plain gradient"):
        p.step()
    assert model[0].weight.grad is None and not torch.equal(model[2].weight.grad, plain)


def test_registration_is_logged_at_loglevel(caplog):
    import logging
    with caplog.at_level(logging.INFO, logger='dkfac'):
        dkfac.KFACPreconditioner(tiny_mlp(), loglevel=logging.INFO)
    assert 'registered 0 (Linear): A 5 x 5, G 6 x 6' in caplog.text
    assert 'registered 2 (Linear): A 7 x 7, G 3 x 3' in caplog.text


# kfac_pytorch v0.4.2's BaseKFACPreconditioner API (its public methods and properties).
KFAC_PYTORCH_BASE_API = ('damping', 'factor_decay', 'factor_update_steps', 'inv_update_steps', 'kl_clip',
                         'load_state_dict', 'lr', 'memory_usage', 'reset_batch', 'state_dict', 'step', 'steps')


def test_preconditioner_is_a_base_kfac_preconditioner():
    p = dkfac.KFACPreconditioner(tiny_mlp())
    assert isinstance(p, dkfac.base_preconditioner.BaseKFACPreconditioner)
    assert dkfac.BaseKFACPreconditioner is dkfac.base_preconditioner.BaseKFACPreconditioner
    assert issubclass(dkfac.preconditioner.KFACPreconditioner, dkfac.base_preconditioner.BaseKFACPreconditioner)
    for name in KFAC_PYTORCH_BASE_API:
        assert name in vars(dkfac.base_preconditioner.BaseKFACPreconditioner), f'{name} is not on the base class'


def test_kfac_pytorch_language_example_annotation_evaluates():
    # kfac_pytorch's examples/language/engine.py, with `import dkfac as kfac`.
    def train(preconditioner: kfac.base_preconditioner.BaseKFACPreconditioner | None) -> None:  # noqa: F821
        pass

    hints = typing.get_type_hints(train, globalns={'kfac': dkfac})
    assert hints['preconditioner'] == dkfac.base_preconditioner.BaseKFACPreconditioner | None


def repr_fields(preconditioner) -> dict[str, str]:
    return dict(re.findall(r'^  (\w+)=(.*),$', repr(preconditioner), re.MULTILINE))


def test_repr_prints_kfac_pytorch_fields():
    fields = repr_fields(dkfac.KFACPreconditioner(tiny_mlp()))
    # kfac_pytorch v0.4.2's KFACPreconditioner repr: its base's fields and its `defaults`.
    expected = {'accumulation_steps', 'allreduce_bucket_cap_mb', 'allreduce_method', 'assignment',
                'assignment_strategy', 'colocate_factors', 'compute_eigenvalue_outer_product', 'compute_method',
                'damping', 'distributed_strategy', 'factor_decay', 'factor_dtype', 'factor_update_steps', 'grad_scaler',
                'grad_worker_fraction', 'inv_dtype', 'inv_update_steps', 'kl_clip', 'layers', 'loglevel', 'lr',
                'skip_layers', 'steps', 'symmetry_aware', 'update_factors_in_hook'}
    assert expected <= set(fields), f'missing: {sorted(expected - set(fields))}'
    assert list(fields) == sorted(fields)
    assert fields['allreduce_method'] == 'AllreduceMethod.ALLREDUCE_BUCKETED'
    assert fields['assignment'] == 'KAISA'
    assert fields['grad_scaler'] == 'False'
    assert fields['loglevel'] == str(logging.DEBUG)
    assert fields['update_factors_in_hook'] == 'True'
    assert fields['large_factor_dim'] == '4096'

    other = repr_fields(dkfac.KFACPreconditioner(tiny_mlp(), allreduce_bucket_cap_mb=0, grad_scaler=lambda: 2.0,
                                                 loglevel=logging.INFO, update_factors_in_hook=False,
                                                 strategy='dp', large_factor_dim=0))
    assert other['allreduce_method'] == 'AllreduceMethod.ALLREDUCE'
    assert other['assignment'] == 'DP-KFAC'
    assert other['grad_scaler'] == 'True'
    assert other['loglevel'] == str(logging.INFO)
    assert other['update_factors_in_hook'] == 'False'
    assert other['large_factor_dim'] == '0'


def run_in_child(code: str) -> str:
    """stdout of `code` run by this interpreter in a new process that imports the same dkfac."""
    package_dir = os.path.dirname(os.path.dirname(dkfac.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_dir, os.environ.get('PYTHONPATH', '')]))
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True, env=env).stdout


def test_configure_allocator_keeps_large_blocks_on_the_heap():
    # In a child process: the setting is process-wide. A 64 MiB tensor is mapped with glibc's defaults and
    # comes from the heap after dkfac.configure_allocator() (mallinfo2's hblkhd counts mapped bytes).
    code = '''
import ctypes, dkfac, torch
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
mapped = lambda: libc.mallinfo2().hblkhd
before = mapped(); t = torch.empty(16 << 20); grew_default = mapped() - before; del t
print(dkfac.configure_allocator())
before = mapped(); t = torch.empty(16 << 20); grew_configured = mapped() - before
print(grew_default >= 64 << 20, grew_configured)
'''
    out = run_in_child(code).split('\n')
    assert out[0] == 'glibc malloc: no mmap, trim threshold 1 GiB'
    assert out[1] == 'True 0', out


def test_import_under_another_torch_version_names_both():
    # dkfac's extension is built for one torch; importing it under another is refused before the extension
    # loads, with both versions named (here the running torch pretends to be another version).
    code = "import torch; built = torch.__version__; torch.__version__ = '2.99.0+other'\n" \
           "try:\n    import dkfac\nexcept ImportError as e:\n    print(built, '|', e)\n"
    out = run_in_child(code)
    built, message = out.split(' | ', 1)
    assert f'dkfac was built against torch {built}' in message, message
    assert 'this Python has torch 2.99.0+other' in message, message
    assert 'pip install .' in message, message


def test_strategy_auto_in_one_process_is_kaisa_and_says_why():
    preconditioner = dkfac.KFACPreconditioner(tiny_mlp(), strategy='auto', memory_budget=1 << 20)
    assert preconditioner.strategy == 'auto'  # as given, like every keyword
    assert 'one process' in preconditioner.strategy_choice
    assert preconditioner.plan.startswith('step plan: single process'), preconditioner.plan


def _replace_parameters(model: torch.nn.Module, state: dict, how: str) -> None:
    if how == 'load_state_dict(assign=True)':  # meta-device initialisation, Hugging Face's loading
        model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    elif how == 'assignment':
        for name, module in model.named_modules():
            for kind in ('weight', 'bias'):
                if getattr(module, kind, None) is not None:
                    setattr(module, kind, torch.nn.Parameter(state[f'{name}.{kind}'].clone()))
    else:  # to() keeps each Parameter object and replaces its data
        model.to(torch.float32)


@pytest.mark.parametrize('how', ['load_state_dict(assign=True)', 'assignment', 'to()'])
def test_replaced_parameters_keep_being_preconditioned(how):
    """The core holds the Parameters it registered; a module whose Parameters were replaced used to have its
    gradients left plain at every later step, without a word. Now step() follows the replacement: the job
    equals one whose preconditioner was built after it."""
    weights = tiny_mlp()
    with torch.no_grad():
        for p in weights.parameters():
            p.mul_(1.5)
    state = weights.state_dict()
    model = tiny_mlp()
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, lr=0.1)
    _replace_parameters(model, state, how)
    reference = tiny_mlp()
    if how != 'to()':
        reference.load_state_dict(state)
    reference_preconditioner = dkfac.KFACPreconditioner(reference, damping=0.01, lr=0.1)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        raw = []
        for m, p in ((model, preconditioner), (reference, reference_preconditioner)):
            m.zero_grad()
            m(x).pow(2).mean().backward()
            raw.append([q.grad.clone() for q in m.parameters()])
            p.step()
        for got, expected, plain in zip(model.parameters(), reference.parameters(), raw[0]):
            assert torch.equal(got.grad, expected.grad), f'step {step}'
            assert not torch.allclose(got.grad, plain), f'step {step}: the gradient was left plain'


def test_a_replacement_of_another_shape_is_refused_naming_the_layer():
    model = tiny_mlp()
    preconditioner = dkfac.KFACPreconditioner(model)
    model[0].weight = torch.nn.Parameter(torch.zeros(7, 4))
    with pytest.raises(RuntimeError, match=r"layer '0': its weight was replaced by a tensor of shape \[7, 4\].*"
                                           r"registered one of shape \[6, 4\]"):
        preconditioner.step()


def _trained():
    model = tiny_mlp()
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.003)
    train(model, preconditioner, 2)
    return model, preconditioner


@pytest.mark.parametrize('change,message', [
    (lambda sd: sd['layers']['0'].update(A=torch.zeros(3, 3)), r"layer '0'.*has shape \[3, 3\]"),
    (lambda sd: sd['layers']['2'].update(G=sd['layers']['2']['G'] * float('nan')), r"layer '2'.*NaN or Inf"),
    (lambda sd: sd.update(damping=-1.0), r'damping'),
    (lambda sd: sd.update(damping='a lot'), r'damping'),
    (lambda sd: sd.update(factor_update_steps=0), r'factor_update_steps'),
])
def test_a_refused_state_dict_changes_nothing(change, message):
    """load_state_dict checks everything, then applies everything: a state dict with one bad entry used to
    leave damping changed, load damping=-1 (every later step then raised), or keep a NaN factor for good."""
    model, preconditioner = _trained()
    before = copy.deepcopy(preconditioner.state_dict())
    bad = copy.deepcopy(before)
    bad['damping'] = 0.5  # a good change that must not land either
    change(bad)
    with pytest.raises((ValueError, RuntimeError), match=message):
        preconditioner.load_state_dict(bad)
    after = preconditioner.state_dict()
    assert after['damping'] == 0.003 and preconditioner.damping == 0.003
    for name, entry in before['layers'].items():
        for key in ('A', 'G'):
            assert torch.equal(after['layers'][name][key], entry[key]), (name, key)


def test_loaded_factors_keep_the_dtype_asked_for():
    model, preconditioner = _trained()
    state = preconditioner.state_dict()
    wide = copy.deepcopy(state)
    for entry in wide['layers'].values():
        entry['A'], entry['G'] = entry['A'].double(), entry['G'].double()
    preconditioner.load_state_dict(wide)
    for entry in preconditioner.state_dict()['layers'].values():
        assert entry['A'].dtype == torch.float32 and entry['G'].dtype == torch.float32
    for name, entry in state['layers'].items():
        assert torch.equal(preconditioner.state_dict()['layers'][name]['A'], entry['A'])


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(factor_update_steps=2**70), ValueError, r'factor_update_steps must be an integer of at most 64 bits, got 1180591620717411303424'),
    (dict(timeout=0), ValueError, r'timeout must be a positive number of seconds.*got 0'),
    (dict(timeout=-5), ValueError, r'timeout must be a positive number of seconds.*got -5'),
    (dict(timeout=float('nan')), ValueError, r'timeout must be a positive number'),
    (dict(process_group=5), TypeError, r'process_group must be a torch.distributed ProcessGroup.*got int'),
])
def test_argument_errors_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        dkfac.KFACPreconditioner(tiny_mlp(), **kwargs)


def test_a_second_preconditioner_on_the_same_model_takes_it_over_at_its_first_step():
    """Two preconditioners on one model both preconditioned its gradients (twice), without a word; then the second
    was refused while the first lived, which stopped Lightning's lr_find or scale_batch_size followed by fit, and a
    second fit (the framework still held the first optimizer). The newer one now takes the layers over at its first
    step(), saying so, and the older one's step() raises. A build that fails, or a preconditioner built and dropped
    without a step, leaves the older one as it was."""
    import copy
    import gc

    model = tiny_mlp()
    first = dkfac.KFACPreconditioner(model)
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    with pytest.raises(ValueError, match='damping'):
        dkfac.KFACPreconditioner(model, damping=-1.0)
    assert dkfac.KFACPreconditioner(model).memory_usage()['total'] == 0  # built, read, dropped
    gc.collect()
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    train(model, first, 1)  # still the model's preconditioner
    reference_model = copy.deepcopy(model)  # the copy's hooks are inert
    reference = dkfac.KFACPreconditioner(reference_model)
    second = dkfac.KFACPreconditioner(model)
    with pytest.warns(UserWarning, match=r"layer '0' \(Linear\) was registered with another KFACPreconditioner, "
                                         r'still alive .* this one, stepped now, takes its layers over'):
        got = train(model, second, 2, start=1)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks  # the first's hooks went
    for got_step, expected_step in zip(got, train(reference_model, reference, 2, start=1)):
        for a, b in zip(got_step, expected_step):
            assert torch.equal(a, b)  # preconditioned once, as a model with one preconditioner is
    model(torch.randn(8, 4)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r'this KFACPreconditioner was superseded by another built on its model '
                                           r"\(layer '0' \(Linear\)\)"):
        first.step()
    second.step()


def test_input_factors_wait_for_the_backward_pass_unless_saved_tensor_hooks_are_active():
    """A Linear's A factor is built when its output gradient arrives, from the input autograd keeps anyway:
    after the forward pass the capture holds those inputs, not factors; under saved-tensor hooks (activation
    checkpointing, offloading), which may drop or move what autograd keeps, it is built at once. Both ways give
    the same preconditioned gradients, bit for bit."""
    def run(hooked: bool) -> tuple[list[int], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        preconditioner = dkfac.KFACPreconditioner(model, damping=0.01)
        held, grads = [], []
        for step in range(3):
            x = torch.randn(64, 32)
            model.zero_grad()
            if hooked:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    out = model(x)
            else:
                out = model(x)
            held.append(preconditioner.memory_usage()['a_batch'])
            out.square().mean().backward()
            preconditioner.step()
            grads += [p.grad.clone() for p in model.parameters()]
        return held, grads

    held, grads = run(hooked=False)
    assert held == [(64 * 32 + 64 * 16) * 4] * 3, held  # the two inputs, as float32
    held_hooked, grads_hooked = run(hooked=True)
    assert held_hooked == [(33 * 33 + 17 * 17) * 4] * 3, held_hooked  # the two factors
    for a, b in zip(grads, grads_hooked):
        assert torch.equal(a, b)


def test_precondition_dtype_tf32_changes_nothing_on_a_cpu_and_bad_values_are_refused():
    """precondition_dtype='tf32' switches cuBLAS's products only: on a CPU the step is exactly the float32 one."""
    def grads(**kwargs) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, **kwargs)
        model(torch.randn(16, 12)).square().mean().backward()
        preconditioner.step()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(), grads(precondition_dtype='tf32')):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match='precondition_dtype') as raised:
        dkfac.KFACPreconditioner(torch.nn.Linear(2, 2), precondition_dtype='float16')
    assert 'tf32' in str(raised.value)
