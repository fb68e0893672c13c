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
