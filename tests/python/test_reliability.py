"""What a user's mistakes and failures do to a running job, in one process: a checkpoint load that is refused or
fails part-way changes nothing (torch.distributed.checkpoint, load_state_dict); a copied, pickled or functionally
called model does not feed the original's preconditioner; a layer never called as a module is named at
construction; a second step() on the same gradients is refused. docs/RELIABILITY.md lists each with what the
user sees."""

from __future__ import annotations

import copy
import io
import pathlib
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dkfac
from test_front_end import train  # the same SGD loop on batch(step), N(0, 1) of size 8 x 4


def mlp(width: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(step))


def trained(width: int = 6, **kwargs) -> tuple[torch.nn.Module, dkfac.KFACPreconditioner]:
    model = mlp(width)
    preconditioner = dkfac.KFACPreconditioner(model, damping=0.003, **kwargs)
    train(model, preconditioner, 3)
    return model, preconditioner


def live_state(preconditioner: dkfac.KFACPreconditioner) -> list[dict[str, torch.Tensor]]:
    """The core's own tensors, cloned (state_dict() hands out copies already; this reads past it)."""
    return [{k: t.clone() for k, t in s.items()} for s in preconditioner._core.layer_states()]


def assert_same_state(before: list[dict[str, torch.Tensor]], preconditioner: dkfac.KFACPreconditioner) -> None:
    after = live_state(preconditioner)
    assert [sorted(s) for s in after] == [sorted(s) for s in before]
    for index, (old, new) in enumerate(zip(before, after)):
        for key in old:
            assert torch.equal(old[key], new[key]), (index, key)


# --- a checkpoint load is a transaction ------------------------------------------------------------------------
def save_checkpoint(directory: pathlib.Path, state: object) -> pathlib.Path:
    dcp.save({'kfac': state}, checkpoint_id=str(directory))
    return directory


def with_inf_factor(directory: pathlib.Path) -> pathlib.Path:
    _, other = trained()
    state = other.state_dict()
    state['layers']['2']['G'][0, 0] = float('inf')
    return save_checkpoint(directory, state)


def truncated(directory: pathlib.Path) -> pathlib.Path:
    _, other = trained()
    save_checkpoint(directory, other)
    data = max(directory.glob('*.distcp'), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return directory


def of_another_width(directory: pathlib.Path) -> pathlib.Path:
    _, other = trained(width=5)
    return save_checkpoint(directory, other)


def of_another_method(directory: pathlib.Path) -> pathlib.Path:
    _, other = trained(compute_method='inverse')
    return save_checkpoint(directory, other)


def of_another_model(directory: pathlib.Path) -> pathlib.Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    other = dkfac.KFACPreconditioner(model)
    train(model, other, 1)
    return save_checkpoint(directory, other)


@pytest.mark.parametrize('make,message', [
    (with_inf_factor, r"layer '2'.*NaN or Inf; nothing was loaded"),
    (truncated, r'.'),  # DCP's own error: the data file ends early
    (of_another_width, r'.'),  # DCP's: the stored tensors have other sizes
    (of_another_method, r'eigen'),  # DCP's: the checkpoint lacks the entries of this job's method (eigen)
    (of_another_model, r'layers\.2'),  # DCP's: the layer names differ
], ids=['inf', 'truncated', 'shape', 'method', 'model'])
def test_a_dcp_load_that_fails_leaves_the_live_state_bit_identical(tmp_path, make, message):
    """dcp.load({'kfac': preconditioner}) fills the tensors of state_dict() in place, then calls load_state_dict:
    state_dict() used to hand out the live tensors, so a refused checkpoint (an Inf factor) was already written
    into the job, and a failure part-way (a truncated file) left half the layers changed."""
    checkpoint = make(tmp_path / 'checkpoint')
    model, preconditioner = trained()
    before = live_state(preconditioner)
    with pytest.raises(BaseException, match=message):  # DCP's CheckpointException is a BaseException
        dcp.load({'kfac': preconditioner}, checkpoint_id=str(checkpoint))
    assert_same_state(before, preconditioner)
    assert preconditioner.steps == 3
    # ... and the job trains on as the uninterrupted one does.
    reference_model, reference = trained()
    train(model, preconditioner, 2, start=3)
    train(reference_model, reference, 2, start=3)
    for got, expected in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(got, expected)


def test_a_dcp_load_that_succeeds_resumes_exactly_and_keeps_no_alias_of_its_input(tmp_path):
    model, preconditioner = trained()
    save_checkpoint(tmp_path / 'c', preconditioner)
    reference_model, reference = copy.deepcopy(model), None
    fresh_model = copy.deepcopy(model)
    fresh = dkfac.KFACPreconditioner(fresh_model, damping=0.003)
    dcp.load({'kfac': fresh}, checkpoint_id=str(tmp_path / 'c'))
    assert_same_state(live_state(preconditioner), fresh)
    # load_state_dict copies: the caller's dict filled again (or changed) afterwards leaves the job alone.
    state = preconditioner.state_dict()
    fresh.load_state_dict(state)
    before = live_state(fresh)
    for entry in state['layers'].values():
        entry['A'].fill_(float('nan'))
    assert_same_state(before, fresh)
    train(model, preconditioner, 2, start=3)
    train(fresh_model, fresh, 2, start=3)
    for got, expected in zip(fresh_model.parameters(), model.parameters()):
        assert torch.equal(got, expected)
    del reference_model, reference



@pytest.mark.parametrize('eigen_adam', [False, True], ids=['eigen', 'eigen_adam'])
def test_a_dcp_load_alone_into_a_fresh_preconditioner_resumes_bit_for_bit(tmp_path, eigen_adam):
    """A fresh preconditioner's state_dict() hands DCP row-major blanks, while the job held LAPACK's column-major
    eigenbases: the loaded job's products rounded otherwise, and Adam's division by sqrt(v) grew that to 1.3e-7
    in 6 steps (float64). Every eigenbasis is row-major since, computed or loaded."""
    options = dict(damping=0.01, inv_update_steps=2, eigen_adam=eigen_adam, stack_layers=False,
                   inv_dtype=torch.float64, kl_clip=None if eigen_adam else 0.001)

    def run(m: torch.nn.Module, p: dkfac.KFACPreconditioner, steps: range) -> None:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in steps:
            optimizer.zero_grad()
            m(batch(step).double()).pow(2).mean().backward()
            p.step()
            optimizer.step()

    model = mlp().double()
    preconditioner = dkfac.KFACPreconditioner(model, **options)
    run(model, preconditioner, range(3))
    save_checkpoint(tmp_path / 'c', preconditioner)
    fresh_model = copy.deepcopy(model)
    fresh = dkfac.KFACPreconditioner(fresh_model, **options)
    dcp.load({'kfac': fresh}, checkpoint_id=str(tmp_path / 'c'))
    for step in range(3, 9):  # three inverse steps among them
        run(model, preconditioner, range(step, step + 1))
        run(fresh_model, fresh, range(step, step + 1))
        for got, expected in zip(fresh_model.parameters(), model.parameters()):
            assert torch.equal(got, expected), step

def test_state_dict_hands_out_copies():
    _, preconditioner = trained()
    state = preconditioner.state_dict()
    before = live_state(preconditioner)
    for entry in state['layers'].values():
        entry['A'].zero_()
    for entry in state['dkfac']['second_order'].values():
        for tensor in entry.values():
            tensor.zero_()
    assert_same_state(before, preconditioner)


# --- hooks belong to one model -----------------------------------------------------------------------------
def factors(preconditioner: dkfac.KFACPreconditioner) -> list[torch.Tensor]:
    return [t.clone() for s in preconditioner._core.layer_states() for k, t in sorted(s.items())]


@pytest.mark.parametrize('copy_of', [
    copy.deepcopy,
    lambda m: torch.optim.swa_utils.AveragedModel(m),
    lambda m: pickle.loads(pickle.dumps(m)),
    lambda m: torch.load(_saved(m), weights_only=False),
], ids=['deepcopy', 'ema', 'pickle', 'torch.save'])
def test_a_copy_of_a_hooked_model_feeds_only_its_own_preconditioner(copy_of):
    """copy.deepcopy of a hooked model copied the hook closures: the copy's passes fed the original's captures
    (factors moved by up to 1.07), and a second preconditioner on the copy was accepted. A copied hook is now
    inert: the copy trains alone, or with a preconditioner of its own, and the original does not notice."""
    model, preconditioner = trained()
    reference_model, reference = trained()
    twin = copy_of(model)
    twin.train()
    before = factors(preconditioner)
    for step in range(3):
        twin(batch(100 + step)).pow(2).mean().backward()
    # The original's next step sees only its own pass (the copy's would have made it 4 passes, and warned).
    train(model, preconditioner, 1, start=3)
    train(reference_model, reference, 1, start=3)
    assert all(torch.equal(a, b) for a, b in zip(factors(preconditioner), factors(reference)))
    assert not all(torch.equal(a, b) for a, b in zip(before, factors(preconditioner)))  # it did train
    # A preconditioner of the copy's own captures the copy's passes, and only those.
    inner = twin.module if isinstance(twin, torch.optim.swa_utils.AveragedModel) else twin
    own = dkfac.KFACPreconditioner(inner, damping=0.003)
    twin_reference = copy.deepcopy(inner)
    twin_reference_kfac = dkfac.KFACPreconditioner(twin_reference, damping=0.003)
    for p in list(inner.parameters()) + list(twin_reference.parameters()):
        p.grad = None
    train(inner, own, 2, start=10)
    train(twin_reference, twin_reference_kfac, 2, start=10)
    assert all(torch.equal(a, b) for a, b in zip(factors(own), factors(twin_reference_kfac)))
    assert all(torch.equal(a, b) for a, b in zip(factors(preconditioner), factors(reference)))


def _saved(model: torch.nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer


def test_functional_call_with_the_models_own_parameters_is_a_pass_of_the_model():
    """torch.func.functional_call runs the same module objects: with the model's own parameters it is one more
    call of the model, captured as such (the same factors as model(x))."""
    model, preconditioner = trained()
    reference_model, reference = trained()
    params = dict(model.named_parameters())
    torch.func.functional_call(model, params, (batch(3),)).pow(2).mean().backward()
    preconditioner.step()
    reference_model(batch(3)).pow(2).mean().backward()
    reference.step()
    assert all(torch.equal(a, b) for a, b in zip(factors(preconditioner), factors(reference)))


# --- layers never called as modules ----------------------------------------------------------------------------
def test_multihead_attentions_out_proj_is_set_aside_at_construction_and_the_rest_trains():
    """nn.MultiheadAttention registers out_proj but applies its weight functionally: with the defaults the first
    step failed, saying the layer "did not run forward/backward"."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    with pytest.warns(UserWarning, match=r"'self_attn.out_proj'.*MultiheadAttention's out_proj.*never calls it"):
        preconditioner = dkfac.KFACPreconditioner(model)
    assert [name for name, _ in preconditioner.layers] == ['linear1', 'linear2']
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(0))
    model(x).pow(2).mean().backward()
    plain = model.linear1.weight.grad.clone()
    preconditioner.step()
    assert not torch.equal(plain, model.linear1.weight.grad)


def test_a_registered_layer_whose_weight_is_used_functionally_is_named_with_the_real_cause():
    class Functional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(4, 6)
            self.second = torch.nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(torch.tanh(self.first(x)), self.second.weight, self.second.bias)

    torch.manual_seed(0)
    model = Functional()
    preconditioner = dkfac.KFACPreconditioner(model)
    model(batch(0)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"'second'.*has a gradient, but its module's hooks saw no forward and "
                                           r'backward pass.*used without calling the module'):
        preconditioner.step()


# --- step() twice ------------------------------------------------------------------------------------------------
def test_a_second_step_on_the_same_gradients_is_refused_and_changes_nothing():
    model = mlp()
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=10)  # steps 1..9 capture nothing
    model(batch(0)).pow(2).mean().backward()
    preconditioner.step()
    once = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r'step\(\) called again on the gradients the last step\(\) \(step 0\) '
                                           r'preconditioned'):
        preconditioner.step()
    assert all(torch.equal(a, p.grad) for a, p in zip(once, model.parameters()))
    assert preconditioner.steps == 1
    # Any new gradient is a new step: a backward pass (accumulating or not), zero_grad, an allreduce's write.
    model(batch(1)).pow(2).mean().backward()
    preconditioner.step()
    for p in model.parameters():
        p.grad.mul_(0.5)
    preconditioner.step()
    model.zero_grad()
    model(batch(2)).pow(2).mean().backward()
    preconditioner.step()
    assert preconditioner.steps == 4


# --- optimizer.step() before step() -----------------------------------------------------------------------------
@pytest.mark.parametrize('make', [lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True)],
                         ids=['sgd', 'sgd_foreach', 'adamw_fused'])
def test_a_step_after_the_optimizers_is_refused_naming_the_layers_and_changes_nothing(make):
    """kfac_pytorch's loop is backward, preconditioner.step(), optimizer.step(): in the other order the optimizer has
    applied the plain gradients before they are preconditioned, and K-FAC has no effect (silently, before)."""
    model = mlp()
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=10)
    optimizer = make(list(model.parameters()))
    model(batch(0)).pow(2).mean().backward()
    optimizer.step()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"step 0 refused: the weights of 2 layers \('0' \(Linear\), '2' "
                                           r'\(Linear\)\) were written in place after their backward pass and before '
                                           r'step\(\): optimizer.step\(\) ran '
                                           r"before the preconditioner's step\(\)"):
        preconditioner.step()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert preconditioner.steps == 0
    # In the right order the same preconditioner trains on, and the steps without captures (1..9) check nothing.
    for step in range(1, 12):
        optimizer.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        preconditioner.step()
        optimizer.step()
    assert preconditioner.steps == 11


def test_an_optimizer_stepping_inside_the_backward_pass_is_refused():
    """torch's optimizer-in-backward pattern (a step in each parameter's post-accumulate-grad hook) applies each
    gradient as it is made: nothing is left for K-FAC to precondition."""
    model = mlp()
    preconditioner = dkfac.KFACPreconditioner(model)
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: optimizers[p].step())
    model(batch(0)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r'step 0 refused: the weights of 2 layers .*or an optimizer steps inside '
                                           r'the backward pass'):
        preconditioner.step()


def test_an_embedding_with_max_norm_written_by_a_forward_after_the_backward_pass_is_not_taken_for_the_optimizer():
    """max_norm renormalizes the looked-up rows in place at every forward: an evaluation between backward and
    step() moved the weight's version and the step was refused. Such a weight is told written by the optimizer
    hook alone, which still refuses the reversed order."""
    def run(evaluate: bool, reverse: bool) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 6, max_norm=1.0), torch.nn.Linear(6, 3))
        preconditioner = dkfac.KFACPreconditioner(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            ids = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            model(ids).pow(2).mean().backward()
            if evaluate:
                with torch.no_grad():
                    model.eval()
                    model(torch.arange(10))
                    model.train()
            if reverse:
                optimizer.step()
            preconditioner.step()
            if not reverse:
                optimizer.step()

    run(evaluate=True, reverse=False)
    with pytest.raises(RuntimeError, match=r"step 0 refused: the weights of 2 layers \('0' \(Embedding\), '1' "):
        run(evaluate=True, reverse=True)


def test_a_compiled_model_stepped_by_a_fused_optimizer_first_is_refused_even_where_its_step_moved_nothing():
    """A compiled forward set no flag the optimizer hook reads, and a fused optimizer moves no version counter:
    with a first step that left the weights as they were (a warmup from lr 0, a GradScaler's skipped step), the
    reversed order was never refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    preconditioner = dkfac.KFACPreconditioner(model)
    compiled = torch.compile(model, backend='eager')
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step))  # lr 0 at step 0
    refused = []
    for step in range(3):
        optimizer.zero_grad()
        compiled(batch(step)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        try:
            preconditioner.step()
        except RuntimeError as error:
            refused.append(str(error).split(' were written')[0])
    assert refused[0] == "step 0 refused: the weights of 2 layers ('0' (Linear), '2' (Linear))", refused


def test_a_step_after_the_optimizers_is_refused_on_a_model_sharded_by_fsdp2(tmp_path):
    """A sharded layer's core sees stand-ins, which the optimizer never writes: the shard it writes is watched (one
    rank, Gloo). Steps in the right order pass."""
    import subprocess
    import sys

    code = f'''
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import dkfac
dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
fully_shard(net[0])
fully_shard(net[2])
fully_shard(net)
preconditioner = dkfac.KFACPreconditioner(net)
optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
for reversed_order in (False, False, False, True):
    optimizer.zero_grad()
    net(torch.randn(4, 5)).sum().backward()
    if reversed_order:
        optimizer.step()
    try:
        preconditioner.step()
        print('accepted')
    except RuntimeError as error:
        print(str(error).split(' were written')[0])
    if not reversed_order:
        optimizer.step()
dist.destroy_process_group()
'''
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    refusal = "step 3 refused: the weights of 2 layers ('0' (FSDPLinear), '2' (FSDPLinear))"
    assert done.stdout.splitlines() == ['accepted'] * 3 + [refusal], done.stdout


# --- a factors-only state ---------------------------------------------------------------------------------------
def _bytes(state: dict) -> int:
    tensors = [t for entry in state['layers'].values() for t in entry.values()]
    tensors += [t for entry in state['dkfac']['second_order'].values() for t in entry.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_factors_only_state_resumes_exactly_after_an_inverse_step_and_is_smaller():
    """state_dict(include_second_order=False): the second-order state is recomputed on load from the factors, which
    is the uninterrupted run's own state where the factors did not change since the last inverse step (the
    decomposition is deterministic), and not elsewhere."""
    def job():
        model = mlp()
        return model, dkfac.KFACPreconditioner(model, damping=0.003, factor_update_steps=1, inv_update_steps=3)

    for saved_after, exact in ((4, True), (5, False)):  # steps 0 and 3 are inverse steps: step 3 is the 4th step()
        model, preconditioner = job()
        train(model, preconditioner, saved_after)
        full = preconditioner.state_dict()
        small = preconditioner.state_dict(include_second_order=False)
        assert _bytes(small) < _bytes(full) / 2, (_bytes(small), _bytes(full))
        resumed_model, resumed = job()
        resumed_model.load_state_dict(model.state_dict())
        resumed.load_state_dict(small)
        train(model, preconditioner, 2, start=saved_after)
        train(resumed_model, resumed, 2, start=saved_after)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
        assert same == exact, (saved_after, same)


def test_a_dcp_checkpoint_of_another_compute_method_loads_with_a_partial_load_planner(tmp_path):
    """DCP's planner refuses a checkpoint that lacks an entry this job's state_dict() has ("Missing key ...
    a_eigenvalues": the checkpoint holds another compute method's second-order state). With
    DefaultLoadPlanner(allow_partial_load=True) the factors load, the checkpoint's compute_method comes with them,
    and load_state_dict recomputes the second-order state from the factors, as it does for a state dict of
    another method."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    _, saved = trained(compute_method='inverse')
    save_checkpoint(tmp_path / 'c', saved)
    _, preconditioner = trained()
    dcp.load({'kfac': preconditioner}, checkpoint_id=str(tmp_path / 'c'),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    _, reference = trained()
    reference.load_state_dict(saved.state_dict())
    assert preconditioner.steps == 3
    for got, expected, source in zip(live_state(preconditioner), live_state(reference), live_state(saved)):
        assert sorted(got) == sorted(expected)
        assert torch.equal(got['a_factor'], source['a_factor']) and torch.equal(got['g_factor'], source['g_factor'])
        for key in got:
            assert torch.equal(got[key], expected[key]), key


# --- what a training loop does between steps ----------------------------------------------------------------------
def block_model() -> torch.nn.Sequential:
    """Three Linear(6, 6) that stack (padded to 8) between an input and a head, float64."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 6)] + [torch.nn.Linear(6, 6) for _ in range(3)] + [torch.nn.Linear(6, 3)]
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())][:-1]).double()


def blocks(model: torch.nn.Module | None = None, **kwargs) -> tuple[torch.nn.Module, dkfac.KFACPreconditioner]:
    model = block_model() if model is None else model
    return model, dkfac.KFACPreconditioner(model, **(dict(damping=0.01, inv_update_steps=2, inv_dtype=torch.float64)
                                                     | kwargs))


def loop(model: torch.nn.Module, preconditioner: dkfac.KFACPreconditioner, steps: range, before=None,
         forward=None, set_to_none: bool = True) -> list[list[torch.Tensor]]:
    """SGD on batch(step) in the model's dtype; `before(step)` runs before each step's passes, `forward(model, x)`
    is the loss (default: the model's squared output)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in steps:
        if before is not None:
            before(step)
        optimizer.zero_grad(set_to_none=set_to_none)
        x = batch(step).to(next(model.parameters()).dtype)
        (forward(model, x) if forward is not None else model(x).pow(2).mean()).backward()
        preconditioner.step()
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        optimizer.step()
    return grads


def assert_equal_grads(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
    for step, (a, b) in enumerate(zip(got, expected)):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y), step


def test_an_empty_batch_is_no_pass():
    """An expert given no tokens (a Linear on 0 rows) failed the backward pass at factor steps, with 'covariance of
    an empty batch' naming no layer. A pass without rows has no covariance: it is not captured, and a micro-batch
    in which the head gets no rows equals one in which it is not called (but for the accumulation warning)."""
    def run(called_empty: bool) -> list[list[torch.Tensor]]:
        model, preconditioner = blocks(accumulation_steps=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            for step in range(4):
                optimizer.zero_grad()
                model(batch(step).double()).pow(2).mean().backward()
                h = model[:-1](batch(100 + step).double())  # the second micro-batch: the head gets no rows
                loss = h.pow(2).mean() + (model[-1](h[:0]).sum() if called_empty else 0)
                loss.backward()
                preconditioner.step()
                grads.append([p.grad.clone() for p in model.parameters()])
                optimizer.step()
        messages = [str(w.message) for w in caught if 'dkfac' in str(w.message)]
        # Not called in one micro-batch, the head ran once of two (warned); given no rows, it ran as declared.
        assert messages == ([] if called_empty else [m for m in messages if "'8'" in m and 'accumulation' in m])
        assert called_empty or messages
        return grads

    assert_equal_grads(run(True), run(False))
    # Only empty passes at a factor step: nothing to build its factors from, named as such.
    model, preconditioner = blocks()
    model[-1](torch.zeros(0, 6, dtype=torch.float64)).sum().backward()
    model(batch(0).double()[:0]).sum().backward()
    with pytest.raises(RuntimeError, match=r"'0'.*ran only on empty batches \(0 rows\).*no tokens"):
        preconditioner.step()
    model, preconditioner = blocks(unused_layer_policy='skip')
    model(batch(0).double()[:0]).sum().backward()
    with pytest.warns(UserWarning, match='only on empty batches'):
        preconditioner.step()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def assert_frozen_at_step_2_is_never_moved(which: str, warned: str, refused: str, refused_set_to_none: bool,
                                           **options) -> None:
    """Layer '2''s `which` ('weight' or 'bias') frozen at step 2, with either zero_grad: under 'skip' the layer is
    warned about (`warned`) and the frozen tensor never moves again; by default its next step, after
    zero_grad(set_to_none=refused_set_to_none), is refused (`refused`)."""
    for set_to_none in (False, True):
        model, preconditioner = blocks(unused_layer_policy='skip', **options)
        frozen = getattr(model[2], which)
        before = {}

        def freeze(step: int) -> None:
            if step == 2:
                frozen.requires_grad_(False)
                before[which] = frozen.detach().clone()

        with pytest.warns(UserWarning, match=warned):
            loop(model, preconditioner, range(5), before=freeze, set_to_none=set_to_none)
        assert torch.equal(frozen, before[which])
    model, preconditioner = blocks(**options)
    loop(model, preconditioner, range(2), set_to_none=refused_set_to_none)
    getattr(model[2], which).requires_grad_(False)
    with pytest.raises(RuntimeError, match=refused):
        loop(model, preconditioner, range(2, 3), set_to_none=refused_set_to_none)


def test_a_weight_frozen_with_its_gradient_zeroed_in_place_is_frozen():
    """requires_grad_(False) on a weight whose gradient zero_grad(set_to_none=False) keeps as zeros: the layer was
    preconditioned as before, its bias's gradient mixed into the weight's, and the frozen weight moved (4e-4 in 3
    SGD steps). It is frozen as with set_to_none=True now: refused by default, its plain gradient under 'skip'."""
    assert_frozen_at_step_2_is_never_moved('weight', warned=r"'2'.*is frozen \(its weight has requires_grad=False\)",
                                           refused=r"'2'.*is frozen", refused_set_to_none=False)


def test_a_layer_frozen_at_the_build_and_unfrozen_later_is_named_once():
    """Fine-tuning: the backbone frozen when the preconditioner is built (set aside), unfrozen at step 2. It trains
    on plain gradients, as before, and step() now says so once, naming it and the way to precondition it (it said
    nothing: K-FAC silently off for the layers the user meant to train with it). A layer named by skip_layers is not
    named."""
    for skip in ([], ['^0$']):
        model = block_model()
        model[0].requires_grad_(False)
        preconditioner = dkfac.KFACPreconditioner(model, damping=0.01, skip_layers=skip)
        assert '0' not in [name for name, _ in preconditioner.layers]

        def unfreeze(step: int) -> None:
            if step == 2:
                model[0].requires_grad_(True)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            loop(model, preconditioner, range(5), before=unfreeze)
        said = [str(w.message) for w in caught if 'frozen when the preconditioner was built' in str(w.message)]
        assert len(said) == (0 if skip else 1), said
        assert not said or "('0')" in said[0] and "with them trainable and unused_layer_policy='skip'" in said[0], said


@pytest.mark.parametrize('fold_in_hooks', [True, False], ids=['fold', 'no-fold'])
def test_a_bias_frozen_while_its_weight_trains_is_never_moved(fold_in_hooks):
    """requires_grad_(False) on a bias whose weight trains: the layer was preconditioned as before and the frozen
    bias, whose zeroed gradient the preconditioned one replaced, moved (6.7e-4 in 3 SGD steps), without a word; with
    set_to_none=True the refusal said the layer 'has no gradient'. It is frozen in part now: refused by default
    naming the bias, its plain gradients under 'skip' (the bias stays where it was)."""
    assert_frozen_at_step_2_is_never_moved('bias', warned=r"'2'.*is frozen in part \(its bias has requires_grad=False",
                                           refused=r"'2'.*its bias has requires_grad=False", refused_set_to_none=True,
                                           fold_in_hooks=fold_in_hooks)


@pytest.mark.parametrize('fold_in_hooks', [True, False], ids=['fold', 'no-fold'])
def test_factor_update_steps_changed_between_steps_applies_to_the_next_forward(fold_in_hooks):
    """The end of step() arms the hooks by the next step's factor interval. Changed after that (kfac_pytorch's
    LambdaParamScheduler.step() after step(), an assignment of _factor_update_steps), the hooks captured the
    next step's passes and step() then found it was no factor step: folded into the factors by the hooks, kept for
    the next factor step without them (0.16 apart). An assignment and the scheduler arm the hooks again: the run
    equals a schedule that says so from the start; a callable that changes by itself is taken as armed, warned."""
    kwargs = dict(fold_in_hooks=fold_in_hooks)
    reference = blocks(factor_update_steps=lambda s: 1 if s < 5 else 3, **kwargs)
    expected = loop(*reference, range(10))
    for attribute in ('factor_update_steps', '_factor_update_steps'):  # public (checked) or kfac_pytorch's private
        assigned = blocks(**kwargs)

        def assign(step: int) -> None:
            if step == 5:
                setattr(assigned[1], attribute, 3)

        assert_equal_grads(loop(*assigned, range(10), before=assign), expected)
    scheduled = blocks(**kwargs)
    scheduler = dkfac.LambdaParamScheduler(scheduled[1], factor_update_steps_lambda=lambda s: 3 if s == 5 else 1)
    optimizer = torch.optim.SGD(scheduled[0].parameters(), lr=0.1)
    got = []
    for step in range(10):  # the scheduler stepped after the preconditioner, as kfac_pytorch's examples do
        optimizer.zero_grad()
        scheduled[0](batch(step).double()).pow(2).mean().backward()
        scheduled[1].step()
        got.append([p.grad.clone() for p in scheduled[0].parameters()])
        optimizer.step()
        scheduler.step()
    assert_equal_grads(got, expected)
    # A callable whose value changes by itself between steps: step 5 stays the factor step the hooks were armed
    # for, with a warning, the same with and without folding in the hooks.
    interval = [1]
    runs = []
    for fold in (True, False):
        model, preconditioner = blocks(factor_update_steps=lambda s: interval[0], fold_in_hooks=fold)
        interval[0] = 1

        def change(step: int) -> None:
            if step == 5:
                interval[0] = 3

        with pytest.warns(UserWarning, match=r'step 5 is a factor step, as the end of the last step\(\) armed'):
            runs.append(loop(model, preconditioner, range(10), before=change))
    assert_equal_grads(*runs)


def test_a_training_mode_forward_after_the_backward_pass_is_dropped_with_or_without_folding():
    """A forward in training mode between backward() and step() (a metric on another batch): folding in the hooks
    dropped its input, folding at step() averaged it into A silently (0.23 apart). Both drop it now, warned; one
    before the real pass is averaged into A by both (as kfac_pytorch does), warned too. Once for all layers."""
    for where in ('after', 'before'):
        runs = []
        for fold in (True, False):
            model, preconditioner = blocks(fold_in_hooks=fold)

            def forward(m, x):
                if where == 'before':
                    m(batch(300).double()).sum()
                return m(x).pow(2).mean()

            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            grads = []
            said = 'after their last backward pass' if where == 'after' else 'whose backward pass never reached them'
            with pytest.warns(UserWarning, match=said) as warned:
                for step in range(5):
                    optimizer.zero_grad()
                    forward(model, batch(step).double()).backward()
                    if where == 'after':
                        model(batch(300 + step).double()).sum()
                    preconditioner.step()
                    grads.append([p.grad.clone() for p in model.parameters()])
                    optimizer.step()
            # One warning for every layer the pass reached (it was one per layer: hundreds in a large model).
            ours = [str(w.message) for w in warned if said in str(w.message)]
            assert len(ours) == 1 and f'{len(preconditioner.layers)} layers (' in ours[0], ours
            assert ') ran 1 forward pass(es) in training mode' in ours[0] and len(preconditioner.layers) > 1, ours
            runs.append(grads)
        assert_equal_grads(*runs)
    # Dropped, it equals the run without that forward.
    model, preconditioner = blocks(fold_in_hooks=False)
    clean = loop(*blocks(fold_in_hooks=False), range(5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(5):
        optimizer.zero_grad()
        model(batch(step).double()).pow(2).mean().backward()
        model(batch(300 + step).double()).sum()
        preconditioner.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    assert_equal_grads(grads, clean)


def test_a_layer_moved_to_another_dtype_leaves_its_stacked_group():
    """module.float() on one of a stacked group's float64 layers (the same Parameters, another dtype) left the
    group planned for float64: the others' gradients were gathered in the first member's dtype (rounded to
    float32, 4e-8 apart from layer by layer). The groups are planned again when a weight's dtype or device moves."""
    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = block_model()

        def forward(self, x):
            for m in self.net:
                x = m(x.to(m.weight.dtype)).double() if isinstance(m, torch.nn.Linear) else m(x)
            return x

    runs = []
    for stack_layers in (True, False):
        model, preconditioner = blocks(Mixed(), stack_layers=stack_layers)

        def convert(step: int, model=model) -> None:
            if step == 3:
                model.net[2].float()

        runs.append(loop(model, preconditioner, range(7), before=convert))
    for step, (a, b) in enumerate(zip(*runs)):  # float32 gathered: 4e-8 apart; rounding: below 1e-10
        for x, y in zip(a, b):
            assert (x.double() - y.double()).norm() <= 1e-10 * y.double().norm(), step


def test_hyper_parameters_assigned_between_steps_equal_a_schedule():
    """docs/PYTHON.md said preconditioner.damping = x works; the properties had no setter (AttributeError). Each
    of damping, factor_decay, kl_clip, lr and both intervals takes a number or a callable of the step, checked as at
    construction, from the next step() on."""
    reference = blocks(damping=lambda s: 0.01 if s < 3 else 0.05, lr=lambda s: 0.1 if s < 3 else 0.2,
                       kl_clip=lambda s: 0.001 if s < 3 else 0.0)
    expected = loop(*reference, range(6))
    model, preconditioner = blocks(lr=0.1)

    def assign(step: int) -> None:
        if step == 3:
            preconditioner.damping = 0.05
            preconditioner.lr = lambda s: 0.2
            preconditioner.kl_clip = None

    assert_equal_grads(loop(model, preconditioner, range(6), before=assign), expected)
    assert (preconditioner.damping, preconditioner.lr, preconditioner.kl_clip) == (0.05, 0.2, 0.0)
    with pytest.raises(ValueError, match='damping must be finite and > 0, got -1'):
        preconditioner.damping = -1
    assert preconditioner.damping == 0.05


class Checkpointed(torch.nn.Module):
    """Two blocks, each LayerNorm -> two Linear layers given its output -> a third: run under
    torch.utils.checkpoint when `reentrant` is set (True or False), plainly when None."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(4, 6)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            norm=torch.nn.LayerNorm(6), q=torch.nn.Linear(6, 6), k=torch.nn.Linear(6, 6), out=torch.nn.Linear(6, 6)))
            for _ in range(2))
        self.head = torch.nn.Linear(6, 3)
        self.double()

    @staticmethod
    def block(b: torch.nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        h = b['norm'](x)
        return x + b['out'](torch.tanh(b['q'](h)) * torch.tanh(b['k'](h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for b in self.blocks:
            x = (self.block(b, x) if self.reentrant is None
                 else torch.utils.checkpoint.checkpoint(self.block, b, x, use_reentrant=self.reentrant))
        return self.head(x)


@pytest.mark.parametrize('reentrant', [False, True], ids=['non-reentrant', 'reentrant'])
def test_activation_checkpointing_equals_the_plain_model_without_a_word(reentrant):
    """torch.utils.checkpoint without reentrance runs each block's forward twice, the second time in the backward
    pass: both inputs were captured and averaged (the same factor), every layer warned of a forward whose backward
    never reached it, no layer could fold in its hook, and the freed inputs' reused addresses made the first step
    suggest sharing the A factor of layers given different tensors. The recomputation is not captured now; the run
    equals the plain model's bit for bit, says nothing, and folds in the hooks (no factor batch waits for step())."""
    runs, usages = [], []
    for mode in (None, reentrant):
        model, preconditioner = blocks(Checkpointed(mode))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            runs.append(loop(model, preconditioner, range(5)))
        messages = [str(w.message) for w in caught if 'dkfac' in str(w.message)]
        # The one suggestion there is to make: each block's q and k read one tensor.
        assert len(messages) == 1 and "2 group(s)" in messages[0], messages
        assert "shared_input_layers=['(q|k)$']" in messages[0], messages
        model(batch(9).double()).pow(2).mean().backward()
        usages.append(preconditioner.memory_usage()['a_batch'])
    assert_equal_grads(*runs)
    assert usages == [0, 0]


def test_a_loaded_state_dict_that_replaces_this_runs_hyper_parameters_says_so():
    """A resume with new arguments (damping=0.05 where the checkpoint has 0.003) silently ran on with the
    checkpoint's values, as kfac_pytorch does: they are still taken, and named, old and new."""
    _, saved = trained()
    state = saved.state_dict()
    _, same = trained()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        same.load_state_dict(state)
    assert not [w for w in caught if 'hyper-parameters replace' in str(w.message)]
    model = mlp()
    other = dkfac.KFACPreconditioner(model, damping=0.05, kl_clip=lambda step: 0.01)
    with pytest.warns(UserWarning, match=r"hyper-parameters replace this preconditioner's: damping 0\.05 -> 0\.003, "
                                         r"kl_clip a callable -> 0\.001"):
        other.load_state_dict(state)
    assert (other.damping, other.kl_clip) == (0.003, 0.001)


def test_a_module_replaced_after_the_build_is_named():
    """A registered module replaced by a new one (model[2] = Linear(...); an untied lm_head that
    resize_token_embeddings makes anew) is never called again: step() said it 'did not run forward/backward',
    whose stated causes do not include this one. It names the replacement now."""
    model, preconditioner = trained()
    model[2] = torch.nn.Linear(6, 3)
    with pytest.raises(ValueError, match=r"layer '2' \(Linear\) is not the model's '2' any more \(a new Linear\): the "
                                         r"preconditioner hooked the module that was there when it was built"):
        train(model, preconditioner, 1, start=3)


def test_the_preconditioners_timeout_defaults_to_the_process_groups(tmp_path):
    """dkfac's own collectives waited torch's default 30 minutes whatever timeout the job's process group was made
    with (a rank that stopped kept the other waiting 90 s where init_process_group said 20): the preconditioner's
    `timeout` now defaults to the group's own."""
    import subprocess
    import sys

    code = f'''
import datetime, torch.distributed as dist
from dkfac.base_preconditioner import _group_timeout
dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=20))
sub = dist.new_group([0], timeout=datetime.timedelta(seconds=7))
print(_group_timeout(dist.group.WORLD), _group_timeout(sub))
dist.destroy_process_group()
'''
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ['20.0', '7.0'], done.stdout


class SharedInACheckpoint(torch.nn.Module):
    """One Linear called twice in one checkpointed segment (weight sharing), between an input and a head."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.inp, self.shared, self.out = torch.nn.Linear(4, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        self.double()

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.shared(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = (self.block(h) if self.reentrant is None
             else torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant))
        return self.out(h)


@pytest.mark.parametrize('reentrant', [False, True], ids=['non-reentrant', 'reentrant'])
def test_a_layer_called_twice_inside_a_checkpoint_is_captured_twice(reentrant):
    """The reentrant kind runs the segment's first forward without gradients (not captured): its recomputation is
    the pass. The skip of recomputations once took the second call of a shared layer there for one (1 input, 2
    gradients: 1.8e-3 apart); only a forward captured under the non-reentrant kind's hooks is recomputed now."""
    runs = []
    for mode in (None, reentrant):
        model, preconditioner = blocks(SharedInACheckpoint(mode), accumulation_steps=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            runs.append(loop(model, preconditioner, range(4)))
        runs[-1].append(sorted(str(w.message) for w in caught if 'dkfac' in str(w.message)))
    assert runs[0][-1] == runs[1][-1]  # the same warnings (the head and input layers ran once of the 2 declared)
    assert_equal_grads(runs[0][:-1], runs[1][:-1])


def test_an_interval_assigned_after_the_backward_pass_leaves_the_step_as_armed():
    """An assignment after the step's forward pass (here after its backward) cannot arm the step's captures
    again: it used to, and the step, armed as no factor step, became one with nothing captured (refused). The step
    stands as armed now (warned), and the interval applies from the next one."""
    model, preconditioner = blocks(factor_update_steps=2)
    loop(model, preconditioner, range(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(batch(1).double()).pow(2).mean().backward()
    preconditioner.factor_update_steps = 1
    with pytest.warns(UserWarning, match=r'step 1 is not a factor step, as the end of the last step\(\) armed'):
        preconditioner.step()
    optimizer.step()
    loop(model, preconditioner, range(2, 4))
    assert preconditioner.steps == 4


def test_a_model_wrapped_in_fsdp1_is_refused_naming_the_wrapper_and_what_works(tmp_path):
    """FSDP1 (FullyShardedDataParallel) hides each layer's weight in a flat parameter: the build used to fail with
    `weight has shape [35], expected 2 dimensions` or 'none of the preconditioned layers has its parameters in the
    base optimizer', and a wrap after the build with 'has no gradient' or 'resized in place'. Both are now refused
    naming FSDP1 and fully_shard, in either of its parameter modes (one rank, Gloo)."""
    import subprocess
    import sys

    code = f'''
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
import dkfac
from dkfac import optim
dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)
for orig in (False, True):
    for after in (False, True):
        net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        try:
            if after:
                preconditioner = dkfac.KFACPreconditioner(net)
                model = FSDP(net, use_orig_params=orig, device_id=torch.device('cpu'))
                model(torch.randn(4, 5)).sum().backward()
                preconditioner.step()
            else:
                model = FSDP(net, use_orig_params=orig, device_id=torch.device('cpu'))
                optim.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1))
            print('accepted')
        except ValueError as error:
            print(str(error).split(' wrapped in ')[0], '|', 'fully_shard' in str(error))
dist.destroy_process_group()
'''
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "dkfac: the model is | True", "dkfac: layer '0' (Linear) was | True",
    ] * 2, done.stdout


@pytest.mark.parametrize('api', ['old', 'parametrize'])
def test_a_layer_under_the_old_weight_norm_is_set_aside_with_its_reason_and_the_rest_trains(api):
    """torch.nn.utils.weight_norm (still in wav2vec2-style models) makes a Linear's weight a tensor computed from
    weight_g and weight_v before each forward pass: the layer was registered, and the first step failed saying it
    "has no gradient before step()". Under torch.nn.utils.parametrize (parametrizations.weight_norm) it was left
    to the optimizer with a word at the loglevel only; both now warn, naming the reason."""
    torch.manual_seed(0)
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # weight_norm's deprecation
        if api == 'old':
            torch.nn.utils.weight_norm(model[0])
        else:
            torch.nn.utils.parametrizations.weight_norm(model[0])
    said = (r"'0' \(Linear\).*weight is no Parameter of the layer.*weight_g and weight_v" if api == 'old' else
            r"'0' \(ParametrizedLinear\).*computed by torch.nn.utils.parametrize")
    with pytest.warns(UserWarning, match=said):
        preconditioner = dkfac.KFACPreconditioner(model)
    assert [name for name, _ in preconditioner.layers] == ['2']
    model(batch(0)).pow(2).mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    preconditioner.step()
    assert [torch.equal(before, p.grad) for before, p in zip(plain, model.parameters())] == [True] * 3 + [False] * 2


def test_a_state_dict_loads_into_the_same_model_under_other_torch_wrappers():
    """A state dict saved from a model names its layers as the model's modules (kfac_pytorch's layout): under
    DataParallel or DistributedDataParallel `module.0`, under torch.compile `_orig_mod.0`. Loading it into the same
    model wrapped otherwise was refused ('holds K-FAC layers this model does not register'); the names now pair
    without the wrappers' parts, and every tensor loads bit for bit. Names that do not pair are still refused."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    _, preconditioner = trained(inv_update_steps=2)
    saved = preconditioner.state_dict()
    expected = live_state(preconditioner)
    for wrap, names in ((torch.compile, ['_orig_mod.0', '_orig_mod.2']),
                        (torch.nn.DataParallel, ['module.0', 'module.2']),
                        (lambda m: torch.nn.Sequential(checkpoint_wrapper(m[0]), m[1], checkpoint_wrapper(m[2])),
                         ['0._checkpoint_wrapped_module', '2._checkpoint_wrapped_module'])):
        wrapped = dkfac.KFACPreconditioner(wrap(mlp()), damping=0.003, inv_update_steps=2)
        wrapped.load_state_dict(saved)
        assert [name for name, _ in wrapped.layers] == names
        assert_same_state(expected, wrapped)
        plain = dkfac.KFACPreconditioner(mlp(), damping=0.003, inv_update_steps=2)
        plain.load_state_dict(wrapped.state_dict())  # and back
        assert_same_state(expected, plain)
    saved['layers']['1'] = saved['layers']['0']
    before = live_state(plain)
    with pytest.raises(ValueError, match=r"does not register: \['1'\] \(names are also matched without torch's"):
        plain.load_state_dict(saved)
    assert_same_state(before, plain)


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize('registered', ['before', 'after'])
def test_a_forward_hook_that_replaces_a_layers_output_leaves_its_factors_alone(registered):
    """G is built from the gradient of the output the layer's forward returned. A user's forward hook registered
    before the preconditioner was built that returns another output (o * 2) used to hand the capture its own
    output's gradient, so G came out 4x too small; the capture's hook now runs before the module's others. Equal, bit
    for bit, to the same function with the scaling as a module of its own."""
    hooked, explicit = mlp(), mlp()
    explicit = torch.nn.Sequential(explicit[0], _Scale(), *explicit[1:])
    if registered == 'before':
        hooked[0].register_forward_hook(lambda module, inputs, output: output * 2)
    preconditioners = [dkfac.KFACPreconditioner(m, factor_update_steps=1, inv_update_steps=1)
                       for m in (hooked, explicit)]
    if registered == 'after':
        hooked[0].register_forward_hook(lambda module, inputs, output: output * 2)
    assert_equal_grads(*(loop(model, preconditioner, range(3))
                         for model, preconditioner in zip((hooked, explicit), preconditioners)))


@pytest.mark.parametrize('layout', ['row-major', 'column-major'])
def test_inverses_loaded_in_either_layout_resume_bit_for_bit(layout):
    """The inverse method kept LAPACK's column-major inverses, while a gathered state dict (a collective's buffers)
    hands row-major ones, so a DP-KFAC or KAISA job resumed from `state_dict(gathered=True)` multiplied by another
    layout and rounded otherwise (1.5e-16 at the first step, growing on an ill-conditioned model). Inverses are
    now row-major as computed and as loaded, whatever the layout of the tensors a state dict holds."""
    options = dict(compute_method='inverse', factor_update_steps=1, inv_update_steps=3, damping=0.003)
    model = mlp()
    preconditioner = dkfac.KFACPreconditioner(model, **options)
    loop(model, preconditioner, range(4))
    state, weights = preconditioner.state_dict(), copy.deepcopy(model.state_dict())
    for entry in state['dkfac']['second_order'].values():
        for key, t in entry.items():
            entry[key] = t.contiguous() if layout == 'row-major' else t.t().contiguous().t()
    expected = loop(model, preconditioner, range(4, 8))
    resumed = mlp()
    resumed.load_state_dict(weights)
    loaded = dkfac.KFACPreconditioner(resumed, **options)
    loaded.load_state_dict(state)
    assert_equal_grads(loop(resumed, loaded, range(4, 8)), expected)


class _ByKeyword(torch.nn.Module):
    """mlp()'s function, its layers called by keyword (`linear(input=x)`), or positionally."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.net, self.keyword = mlp(), keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, _, last = self.net
        h = torch.tanh(first(input=x) if self.keyword else first(x))
        return last(input=h) if self.keyword else last(h)


def test_a_layer_called_with_its_input_by_keyword_is_captured_as_called_positionally():
    """A forward hook registered without kwargs sees no keyword argument: `linear(input=x)` failed the forward
    pass with a bare IndexError from dkfac's hook. The capture now reads the input either way; equal bit for bit."""
    grads = []
    for keyword in (True, False):
        model = _ByKeyword(keyword)
        preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        for step in range(2):
            model.zero_grad()
            model(batch(step)).pow(2).mean().backward()
            preconditioner.step()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_hook_copied_from_a_model_pickled_before_the_hooks_took_keywords_stays_inert():
    """A model pickled with a hooked layer carries an inert copy of the capture hook, registered as it was then
    (without keywords): torch calls it with three arguments, which must not fail the forward pass."""
    from dkfac.base_preconditioner import _CaptureHook

    model = mlp()
    model[0].register_forward_hook(_CaptureHook(None, None))  # as unpickled from a model saved then
    model(batch(0)).sum().backward()


class _LearnedPositions(torch.nn.Embedding):
    """As transformers' learned positional embeddings: given the ids, it looks up their positions."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(torch.arange(ids.shape[-1]).expand_as(ids))


class _PlainSubclass(torch.nn.Embedding):
    pass


def test_a_layer_whose_class_overrides_the_stock_forward_is_set_aside_naming_why():
    """Whisper's, BART's and OPT's learned positional embeddings subclass Embedding and look up positions, not the
    ids they are given: they were registered and captured as if they looked up their argument (an IndexError in the
    hook where ids passed the positions' count, silently wrong A below it). A class that overrides the stock layer's
    forward is now set aside with its reason; a subclass that keeps it is registered."""
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = _PlainSubclass(50, 8), _LearnedPositions(6, 8)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.tokens(ids) + self.positions(ids))

    model = Model()
    with pytest.warns(UserWarning, match=r"'positions' \(_LearnedPositions\) keeps its plain gradient: its class "
                                         r"overrides Embedding.forward"):
        preconditioner = dkfac.KFACPreconditioner(model)
    assert [name for name, _ in preconditioner.layers] == ['tokens', 'head']
    ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(0))  # ids past the 6 positions
    model(ids).pow(2).mean().backward()
    preconditioner.step()


@pytest.mark.parametrize('rows', [(12,), (3, 4)], ids=['2-d', '3-d'])
def test_a_layer_output_written_in_place_is_captured_as_one_written_out_of_place(rows):
    """ReLU(inplace=True) after Linear layers of a 3-D input (a sequence): the Linear's output is a view of its
    product's rows, and a hook on a view does not fire once the view is written in place; the first step refused
    the layers (`has a gradient, but its module's hooks saw no forward and backward pass`). The gradient is taken on
    the product's rows, reshaped: equal bit for bit to the same model with out-of-place ReLUs."""
    def grads(inplace: bool) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(inplace=inplace), torch.nn.Linear(6, 6),
                                    torch.nn.ReLU(inplace=inplace), torch.nn.Linear(6, 3))
        preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2)
        return train(model, preconditioner, 4, size=(*rows, 4))

    for got, expected in zip(grads(True), grads(False), strict=True):
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
