"""dkfac on CUDA tensors (pytest -m gpu; scripts/gpu_check.sh): against the CPU float64 reference, with at most one
host synchronisation per step, under torch.autocast with torch.amp.GradScaler, and under torch.distributed (NCCL for
one rank; two ranks sharing the GPU through Gloo) against the single-process reference. Without a CUDA device every
test here is skipped with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

# No TF32 anywhere in these tests or the workers they start (cuBLAS and cuDNN read this when they start): torch
# 2.11 leaves cuDNN's TF32 on for float32 convolutions, about 5e-4 relative, beyond the 1e-4 comparisons with the
# CPU float64 reference. The fixture below also turns torch's own switches off.
os.environ.setdefault('NVIDIA_TF32_OVERRIDE', '0')
os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # cuBLAS's deterministic mode (the fixture asks for it)

import dkfac  # noqa: E402
import scenarios  # noqa: E402
from test_distributed import close
from test_distributed import COMMON
from test_distributed import reference
from test_distributed import run_workers
from test_distributed import STEPS
from test_front_end import factors_under_autocast

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason='no CUDA device visible: GPU tests run on a GPU machine '
                                                         '(scripts/gpu_check.sh)')]


@pytest.fixture(autouse=True)
def exact_cuda_math():
    """TF32 and reduced-precision float16/bfloat16 reductions off, deterministic algorithms on, for the test."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
             torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch 2.9+ prefers its fp32_precision settings; these still apply
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
         torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, torch.backends.cudnn.deterministic,
         torch.backends.cudnn.benchmark) = saved[:6]
        torch.use_deterministic_algorithms(saved[6], warn_only=True)


def train(device: str, dtype: torch.dtype, steps: int = 4, kind: str = 'cnn', **kwargs) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = scenarios.make_model(kind).to(device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, inv_update_steps=2, **kwargs)
    grads = []
    for step in range(steps):
        x, y = scenarios.batch(kind, step, size=16)
        x = x.to(device) if kind == 'lm' else x.to(device, dtype)  # the language model's input is token ids
        optimizer.zero_grad()
        scenarios.loss_of(kind, model(x), y.to(device)).backward()
        preconditioner.step()
        grads.append([p.grad.to('cpu', torch.float64) for p in model.parameters()])
        optimizer.step()
    return grads


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_cuda_float32_matches_cpu_float64(method):
    expected = train('cpu', torch.float64, compute_method=method)
    got = train('cuda', torch.float32, compute_method=method)
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


# second_order_lag (docs/MATH.md section 2.8): the updates of steps 2, 4 and 6 computed by another thread on a side
# stream and installed lag steps later, on the main stream; against the same lag on the CPU in float64 (on this
# machine's CPU, float32 is 1.1e-6 from it; the lag moves the gradients 19-56% from the exact mode's).
@pytest.mark.parametrize('kwargs', [dict(second_order_lag=1), dict(second_order_lag=2, compute_method='inverse'),
                                    dict(second_order_lag=1, kind='lm', diagonal_factor_dim=16)],
                         ids=['eigen-1', 'inverse-2', 'lm-1'])
def test_lagged_second_order_on_a_side_stream_matches_cpu_float64(kwargs):
    expected = train('cpu', torch.float64, steps=8, **kwargs)
    got = train('cuda', torch.float32, steps=8, **kwargs)
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


# second_order_concurrency on CUDA: each layer's decomposition from a host thread of its own on a stream of its own
# (inside the job's thread, with second_order_lag); against the CPU float64 reference, one layer at a time.
@pytest.mark.parametrize('kwargs', [dict(second_order_concurrency=3),
                                    dict(second_order_concurrency=3, compute_method='inverse'),
                                    dict(second_order_concurrency=0, second_order_lag=1, kind='lm',
                                         diagonal_factor_dim=16)],
                         ids=['eigen-3', 'inverse-3', 'lm-all-lag-1'])
def test_concurrent_second_order_on_streams_matches_cpu_float64(kwargs):
    expected = train('cpu', torch.float64, steps=6,
                     **{k: v for k, v in kwargs.items() if k != 'second_order_concurrency'})
    got = train('cuda', torch.float32, steps=6, **kwargs)
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


# stack_layers (docs/MATH.md section 2.9, on by default): layers of one shape preconditioned with batched products
# from stacked state, with shared A sides and KL clipping, and with the stacks' widths padded to a multiple of 8
# (pad_widths: the [16, 17] layers held at [16, 24]); against the CPU float64 reference layer by layer.
@pytest.mark.parametrize('kwargs', [dict(), dict(compute_method='inverse', shared_input_layers=['(query|key|value)$']),
                                    dict(pad_widths=8, shared_input_layers=['(query|key|value)$'])],
                         ids=['eigen', 'inverse-shared', 'eigen-shared-padded'])
def test_stacked_layers_match_cpu_float64_layer_by_layer(kwargs):
    import test_stack_layers as stack
    expected, _, _ = stack.train('cpu', torch.float64, 7, stack_layers=False, kl_clip=1e-4, **kwargs)
    got, _, _ = stack.train('cuda', torch.float32, 7, kl_clip=1e-4, **kwargs)
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


# eigen_adam stacked on CUDA (the batched products, torch's fused Adam kernel on each layer's slice) against
# eigen_adam layer by layer on CUDA, each step from one state (test_stack_layers.in_lockstep), float32. adam_eps 1e-3:
# P's entries that are 0 but for rounding come out of Adam's first step at rounding / eps, which float32's rounding
# and the default 1e-8 would make of order 1 (a CPU float64 reference would differ there too); here they stay small.
def test_stacked_eigen_adam_on_cuda_matches_layer_by_layer():
    import test_stack_layers as stack
    kwargs = dict(kl_clip=0.0, eigen_adam=True, adam_eps=1e-3, shared_input_layers=['(query|key|value)$'])
    stacked = stack.stack_model('cuda', torch.float32, **kwargs)
    plain = stack.stack_model('cuda', torch.float32, stack_layers=False, **kwargs)
    differences = stack.in_lockstep(stacked, plain, 8, device='cuda', dtype=torch.float32)  # rotations at 3 and 6
    assert max(differences) < 1e-4, differences


@pytest.mark.parametrize('passes', [1, 2])
def test_fold_in_hooks_on_cuda_matches_cpu_float64(passes):
    """fold_in_hooks (docs/MATH.md section 1.8) on CUDA: folded on autograd's device thread, against the CPU float64
    reference folded at step(); no batch is held when a backward pass ends after the first factor update."""
    import test_fold_in_hooks as fold
    expected, _, _ = fold.run(passes, 6, fold_in_hooks=False)
    got, held, _ = fold.run(passes, 6, 'cuda', torch.float32)
    assert held[0] > 0 and all(h == 0 for h in held[1:]), held
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


# The layer kinds of a transformer on CUDA (docs/MATH.md section 7): an Embedding (its A diagonal, token counts
# by index_add_), a Conv1D (weight stored [in, out]) and a 40-token head whose G is kept diagonal.
@pytest.mark.parametrize('kwargs', [dict(compute_method='eigen'), dict(compute_method='inverse'),
                                    dict(kfac_approx='reduce')], ids=['eigen', 'inverse', 'reduce'])
def test_language_model_on_cuda_matches_cpu_float64(kwargs):
    kwargs = dict(kind='lm', diagonal_factor_dim=16, **kwargs)
    expected = train('cpu', torch.float64, **kwargs)
    got = train('cuda', torch.float32, **kwargs)
    for step, (g, e) in enumerate(zip(got, expected)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


@pytest.mark.parametrize('storage', [torch.bfloat16, torch.float16])
def test_half_storage_matches_cpu_with_the_same_storage(storage):
    """float16: CUDA within its round-off of the CPU's run at every step. bfloat16's coarser rounding sends the
    trajectories apart on any device (on an H200 the CPU's bfloat16 run was 7.7% from float64 at step 3, CUDA's
    0.8%; docs/GPU.md): CUDA is held to the CPU at the first step, where both start alike, and at every step to
    float64 within twice the CPU's own worst error (at least 5%)."""
    kwargs = dict(factor_dtype=storage, inv_dtype=storage)
    on_cpu = train('cpu', torch.float32, **kwargs)
    on_cuda = train('cuda', torch.float32, **kwargs)

    def error(a, b):
        return ((a - b).norm() / (b.norm() + 1e-12)).item()

    if storage is torch.float16:
        for step, (g, e) in enumerate(zip(on_cuda, on_cpu)):
            for i, (a, b) in enumerate(zip(g, e)):
                assert error(a, b) <= 5e-3, f'step {step}, parameter {i}'
        return
    for i, (a, b) in enumerate(zip(on_cuda[0], on_cpu[0])):
        assert error(a, b) <= 3e-2, f'first step, parameter {i}'
    float64 = train('cpu', torch.float64)
    cpu_worst = max(error(a, b) for g, e in zip(on_cpu, float64) for a, b in zip(g, e))
    bound = max(5e-2, 2 * cpu_worst)
    for step, (g, e) in enumerate(zip(on_cuda, float64)):
        for i, (a, b) in enumerate(zip(g, e)):
            assert error(a, b) <= bound, f'step {step}, parameter {i}: CPU worst {cpu_worst:.4f}'


@pytest.mark.parametrize('kind', ['cnn', 'lm'])
def test_a_step_without_decompositions_does_not_synchronise(kind):
    model = scenarios.make_model(kind).cuda()
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, inv_update_steps=100, diagonal_factor_dim=16)
    for step in range(4):
        x, y = scenarios.batch(kind, step, size=16)
        model.zero_grad()
        scenarios.loss_of(kind, model(x.cuda()), y.cuda()).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('warn')
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                preconditioner.step()
        finally:
            torch.cuda.set_sync_debug_mode('default')
        syncs = [w for w in caught if 'synchroniz' in str(w.message)]
        # Step 0 decomposes (torch.linalg.eigh checks its result on the host) and folds first factors. The later
        # steps (factor steps, no decomposition) have none: the guard's rows reach the host by a copy that no one
        # waits for, read at a later step() once the device is past it (it was one synchronisation a step).
        if step >= 1:
            assert len(syncs) == 0, f'step {step}: {len(syncs)} host synchronisations: {[str(w.message) for w in syncs]}'
    assert preconditioner.events()['fallbacks'] == 0  # the getter waits for the last step's report


def test_wide_factors_built_as_a_triangle_match_cpu_float64():
    """A factor 2048 wide or more is built on the GPU as its upper block triangle, mirrored (math/gemm.cpp): exactly
    symmetric, and within float32 rounding of the CPU float64 factor of the same inputs."""
    def factors(device: str, dtype: torch.dtype) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2303, 2560), torch.nn.Tanh(), torch.nn.Linear(2560, 3))
        model = model.to(device, dtype)
        preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, damping=0.01)
        x = torch.randn(512, 2303, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        model(x.to(device, dtype)).square().mean().backward()
        preconditioner.step()
        return preconditioner.state_dict()['layers']

    got, expected = factors('cuda', torch.float32), factors('cpu', torch.float64)
    checked = 0
    for name, layer in expected.items():
        for factor in 'AG':
            want, have = layer[factor], got[name][factor].double().cpu()
            if want.shape[0] < 2048:
                continue
            checked += 1
            assert torch.equal(have, have.t()), (name, factor)
            assert (have - want).norm() / want.norm() < 1e-5, (name, factor)
    assert checked == 3  # the first layer's A (2304 wide) and G (2560), the second layer's A (2561)


_TF32_CHILD = r"""
import json, sys
import torch
import dkfac
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def preconditioned(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.Tanh(), torch.nn.Linear(384, 256)).cuda()
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, kl_clip=0, **kwargs)
    for step in range(3):  # no optimizer step: the parameters, factors and decompositions stay the same
        model.zero_grad()
        x = torch.randn(256, 512, generator=torch.Generator().manual_seed(step)).cuda()
        model(x).square().mean().backward()
        preconditioner.step()
    switch = torch.backends.cuda.matmul.allow_tf32
    return [p.grad.double() for p in model.parameters()], switch


exact, _ = preconditioned()
fast, switch = preconditioned(precondition_dtype='tf32')
print(json.dumps({'errors': [float((f - e).norm() / e.norm()) for f, e in zip(fast, exact)], 'switch': switch}))
"""


def test_tf32_preconditioning_is_close_to_float32_and_leaves_the_switch_as_it_was(tmp_path):
    """precondition_dtype='tf32' (a fast mode): the preconditioning products run in TF32, so V differs from the exact
    mode's, within TF32's rounding; factors and decompositions stay float32 (both preconditioners build the same
    state); torch's TF32 switch is off again after step(). In a child process without this file's
    NVIDIA_TF32_OVERRIDE=0, which keeps cuBLAS from TF32 whatever torch asks (the first GPU run of this test, in this
    process, saw V exactly equal)."""
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip('TF32 needs compute capability 8.0 (Ampere) or newer')
    env = {k: v for k, v in os.environ.items() if k != 'NVIDIA_TF32_OVERRIDE'}
    here = os.path.dirname(os.path.dirname(os.path.abspath(dkfac.__file__)))  # the dkfac this test imported
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [here, env.get('PYTHONPATH')]))
    script = tmp_path / 'tf32_child.py'
    script.write_text(_TF32_CHILD)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result['switch'] is False, 'the TF32 switch is left as it was'
    errors = result['errors']
    assert max(errors) < 1e-2, errors
    assert min(errors) > 0, f'TF32 products differ from IEEE float32 ones: {errors}'


class _Heads(torch.nn.Module):
    """Many wide-input, narrow-output Linear heads on one input: second-order state (a^2) far above V (g a)."""

    def __init__(self, heads: int, width: int, out: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, out) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(head(x) for head in self.heads)


@pytest.mark.parametrize('method', ['eigen', 'inverse'])
def test_inverse_step_holds_one_layers_new_state_at_a_time(method):
    """Second order layer by layer: an inverse step's memory above what it started with stays near one layer's
    state (its old and new copies and the decomposition's workspace), not every layer's second copy."""
    torch.manual_seed(0)
    model = _Heads(heads=16, width=1024, out=64).cuda()
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, compute_method=method, factor_update_steps=1,
                                              inv_update_steps=1, kl_clip=0)
    peaks = []
    for step in range(3):
        model.zero_grad()
        model(torch.randn(256, 1024, device='cuda')).square().mean().backward()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        preconditioner.step()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    usage = preconditioner.memory_usage()
    second_order = usage['a_inverses'] + usage['g_inverses']
    assert second_order > 16 * 1024**2 * 4 - 1, usage  # at least every head's [1025, 1025] float32 matrix
    # From the second step on each layer's state replaces one that exists: every layer's second copy at once
    # would add `second_order` bytes; one layer at a time adds a few layers' worth.
    assert max(peaks[1:]) < 0.5 * second_order, (peaks, usage)


@pytest.mark.parametrize('dtype,scale,loss_scale', [(torch.bfloat16, 1.0, None), (torch.float16, 8.0, None),
                                                    (torch.float16, 1.0, 2.0 ** 12)],
                         ids=['bfloat16', 'float16-overflow', 'float16-grad-scaler'])
def test_factors_under_autocast_equal_float32_factors_of_the_same_inputs(dtype, scale, loss_scale):
    """Under CUDA autocast (and the real GradScaler), the factors are the float32 factors of what the layers saw,
    against a reference built outside autocast; in float16 the first convolution's sums would pass 65504."""
    got, expected = factors_under_autocast('cuda', dtype, scale, loss_scale)
    for name in expected:
        for factor in 'AG':
            a, b = got[name][factor], expected[name][factor]
            assert a.dtype == torch.float32 and torch.isfinite(a).all(), (name, factor, a.dtype)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=f'{name} {factor}')


def test_nccl_serves_a_one_rank_job(tmp_path):
    results = run_workers(1, {**COMMON, 'device': 'cuda', 'backend': 'nccl'}, tmp_path)
    expected = reference(1, COMMON)
    for step in range(STEPS):
        for a, b in zip(results[0]['grads'][step], expected[step]):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8


# FSDP2 on a one-rank NCCL mesh: the sharded path (DTensor gradients gathered, rows copied back) on CUDA tensors.
# Two ranks cannot share one GPU under NCCL, and Gloo has no reduce-scatter for CUDA tensors.
@pytest.mark.parametrize('model', ['cnn', 'lm'])
def test_nccl_serves_a_one_rank_fsdp2_job(model, tmp_path):
    kwargs = {**COMMON, 'model': model, 'diagonal_factor_dim': 16}
    results = run_workers(1, {**kwargs, 'device': 'cuda', 'backend': 'nccl', 'shard': 'fsdp'}, tmp_path)
    expected = reference(1, kwargs)
    for step in range(STEPS):
        for i, (a, b) in enumerate(zip(results[0]['grads'][step], expected[step])):
            assert (a - b).norm() <= 1e-4 * b.norm() + 1e-8, f'step {step}, parameter {i}'


@pytest.mark.parametrize('kwargs', [dict(strategy='kaisa', grad_worker_fraction=1.0),
                                    dict(strategy='kaisa', grad_worker_fraction=0.5, compute_method='inverse'),
                                    dict(strategy='spd'),
                                    dict(strategy='kaisa', grad_worker_fraction=0.5, model='lm', diagonal_factor_dim=16),
                                    dict(strategy='kaisa', grad_worker_fraction=0.5, inv_update_steps=1,
                                         second_order_lag=1)],
                         ids=['kaisa-1', 'kaisa-0.5-inverse', 'spd', 'lm-kaisa-0.5', 'kaisa-0.5-lag-1'])
def test_two_ranks_share_the_gpu_through_gloo(kwargs, tmp_path):
    results = run_workers(2, {**COMMON, **kwargs, 'device': 'cuda', 'backend': 'gloo'}, tmp_path)
    expected = reference(2, {**COMMON, **kwargs})
    for rank, result in enumerate(results):
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(result['grads'][step], expected[step])):
                assert close(a, b), f'rank {rank}, step {step}, parameter {i}: max diff {(a - b).abs().max()}'


# Tensor parallel on CUDA tensors (float64, against the CPU float64 reference of the sliced model): a one-rank NCCL
# mesh (the slice is the whole layer), and two ranks sharing the GPU through Gloo (its CUDA allreduce serves the
# column and row layers' redistributions; sequence parallelism would need a CUDA reduce-scatter, which Gloo lacks).
# 'vocabulary': the language model with its Embedding split by its vocabulary (a vocabulary slice's capture on CUDA).
@pytest.mark.parametrize('ranks,backend,kind', [(1, 'nccl', 'mlp'), (2, 'gloo', 'mlp'), (2, 'gloo', 'vocabulary')])
def test_tensor_parallel_on_cuda_matches_cpu_float64(ranks, backend, kind, tmp_path):
    import test_tensor_parallel as tp
    import workers

    vocabulary = kind == 'vocabulary'
    model = 'lm' if vocabulary else kind
    results = workers.run_workers('tensor_parallel_worker.py', ranks,
                                  {'tp': ranks, 'dp': 1, 'device': 'cuda', 'backend': backend, 'model': model,
                                   'vocabulary_parallel': vocabulary}, tmp_path)
    if ranks == 2:
        tp.check(results, tp.reference(1, model, False, vocabulary=vocabulary), rtol=1e-9, atol=1e-12)
    else:
        tp.check(results, tp.whole_reference(1, 'mlp', False, tp=1), tp=1, rtol=1e-9, atol=1e-12)


def test_a_compiled_model_on_cuda_matches_the_eager_one():
    """The capture's custom operators (dkfac::capture_input, dkfac::capture_output_grad) inside a compiled model's
    CUDA graphs: one forward and one backward graph, no graph break, the eager model's K-FAC gradients (aot_eager:
    no Triton compilation, which the GPU check's time cannot spare)."""
    from torch._dynamo.utils import counters
    import test_compile

    torch._dynamo.reset()
    counters.clear()

    def run(compiled: bool) -> list[list[torch.Tensor]]:
        model = test_compile.make_model().cuda()
        preconditioner = dkfac.KFACPreconditioner(model, kl_clip=None, factor_update_steps=2, inv_update_steps=4)
        forward = torch.compile(model, backend='aot_eager') if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        for step in range(6):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step)).cuda()
            optimizer.zero_grad()
            forward(x).pow(2).mean().backward()
            preconditioner.step()
            grads.append([p.grad.cpu() for p in model.parameters()])
            optimizer.step()
        return grads

    eager, compiled = run(False), run(True)
    assert sum(counters['graph_break'].values()) == 0, dict(counters['graph_break'])
    assert counters['stats']['unique_graphs'] == 1
    for step, (got, expected) in enumerate(zip(compiled, eager)):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f'step {step}')


# cuda_graphs (Note [a step's CUDA graph], dkfac/preconditioner_graph.cpp): the steps without factor or second-order
# updates replay one captured CUDA graph of their preconditioning, guard and gradient writes, and every step's
# gradients equal the eager run's bit for bit, through a learning rate that changes at every step (KL clipping reads
# it on the device). These models' layers have no other layer of their shape (or a diagonal factor), so each keeps its
# own second-order tensors, which every update makes anew: the key changes at each inverse step (4), and of the two
# steps without updates that follow, the first runs eagerly and the second captures and replays. With the gradients
# kept (zero_grad(set_to_none=False)) that is 4 replays in 16 steps; set to None (zero_grad's default), a step
# replays where the backward pass gave the gradients their memory back, and is eager where it did not: the report
# says which, and the results are the same either way. eigen_adam (KL clipping off) the same: its moments, stepped and
# rotated in place, are rotated at the inverse steps, which are update steps.
@pytest.mark.parametrize('kind', ['cnn', 'lm'])
@pytest.mark.parametrize('set_to_none', [False, True], ids=['kept', 'none'])
@pytest.mark.parametrize('eigen_adam', [False, True], ids=['kfac', 'eigen-adam'])
def test_cuda_graphs_equal_eager_steps_bit_for_bit(kind, set_to_none, eigen_adam):
    def run(cuda_graphs: bool):
        torch.manual_seed(0)
        model = scenarios.make_model(kind).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, factor_update_steps=2, inv_update_steps=4,
                                                  kl_clip=0.0 if eigen_adam else 1e-3, eigen_adam=eigen_adam,
                                                  lr=lambda step: 0.1 * (1 + 0.05 * step),
                                                  diagonal_factor_dim=16, cuda_graphs=cuda_graphs)
        grads = []
        for step in range(16):
            x, y = scenarios.batch(kind, step, size=16)
            optimizer.zero_grad(set_to_none=set_to_none)
            scenarios.loss_of(kind, model(x.cuda()), y.cuda()).backward()
            preconditioner.step()
            grads.append([p.grad.cpu() for p in model.parameters()])
            optimizer.step()
        return grads, preconditioner.cuda_graph_report()

    eager, eager_report = run(False)
    graphed, report = run(True)
    for step, (got, expected) in enumerate(zip(graphed, eager)):
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), f'step {step}, parameter {i}: {(a - b).abs().max().item()} apart; {report}'
    assert eager_report['eager_steps'] == 0  # the option off: nothing counted
    assert report['off'] == '', report
    assert report['replays'] + report['eager_steps'] == 16, report
    if not set_to_none:  # steps 3, 7, 11 and 15
        assert report['captures'] == 4 and report['replays'] == 4, report
    print(f'{kind}, set_to_none={set_to_none}, eigen_adam={eigen_adam}: {report}')
