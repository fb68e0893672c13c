"""Tensor parallel (torch.distributed.tensor.parallel): each rank preconditions its slice of every split layer as a
layer of its own, with block-diagonal factors (docs/MATH.md section 9), its factors averaged over its data-parallel
group only, and KL clipping summed over the tensor-parallel group, counting once the layers every rank holds whole.
The job equals one process preconditioning the model with each split layer written as its slices."""
import functools

import pytest
import torch

import dkfac
import tensor_parallel_worker as worker
import workers

run = functools.partial(workers.run_workers, 'tensor_parallel_worker.py')
TP = 2


def rows(module: torch.nn.Linear, k: int) -> torch.nn.Linear:
    """Slice k of a column-parallel Linear: its k-th block of output features (and of the bias)."""
    part = torch.nn.Linear(module.in_features, module.out_features // TP, dtype=torch.float64)
    part.weight.data.copy_(module.weight.data.chunk(TP, 0)[k])
    part.bias.data.copy_(module.bias.data.chunk(TP, 0)[k])
    return part


def columns(module: torch.nn.Linear, k: int) -> torch.nn.Linear:
    """Slice k of a row-parallel Linear: its k-th block of input features, the bias with the first."""
    part = torch.nn.Linear(module.in_features // TP, module.out_features, bias=k == 0 and module.bias is not None,
                           dtype=torch.float64)
    part.weight.data.copy_(module.weight.data.chunk(TP, 1)[k])
    if part.bias is not None:
        part.bias.data.copy_(module.bias.data)
    return part


class Sliced(torch.nn.Module):
    """worker.Block with each split layer as TP layers: `up` (and `embed`, and the head under sequence parallelism)
    by output features, `down` by input features with the bias on the first slice. In one process it computes what
    the split model computes; K-FAC then gives each slice its own factors, the tensor-parallel job's blocks. An
    Embedding split by its `vocabulary` stays whole: the blocks of its diagonal A are the whole A's, so its slices'
    K-FAC is the whole layer's."""

    def __init__(self, whole: worker.Block, split_head: bool, vocabulary: bool = False) -> None:
        super().__init__()
        self.embed = None
        self.whole_embed = whole.embed if vocabulary else None
        if whole.embed is not None and not vocabulary:
            self.embed = torch.nn.ModuleList(torch.nn.Embedding.from_pretrained(
                whole.embed.weight.data.chunk(TP, 1)[k].clone(), freeze=False) for k in range(TP))
        self.norm = whole.norm
        self.up = torch.nn.ModuleList(rows(whole.up, k) for k in range(TP))
        self.down = torch.nn.ModuleList(columns(whole.down, k) for k in range(TP))
        self.head = torch.nn.ModuleList(rows(whole.head, k) for k in range(TP)) if split_head else whole.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (self.whole_embed(x) if self.whole_embed is not None
             else torch.cat([e(x) for e in self.embed], -1) if self.embed is not None else x)
        u = torch.tanh(torch.cat([part(self.norm(h)) for part in self.up], -1))
        h = h + sum(part(c) for part, c in zip(self.down, u.chunk(TP, -1)))
        return torch.cat([part(h) for part in self.head], -1) if isinstance(self.head, torch.nn.ModuleList) \
            else self.head(h)

    def local_grads(self, k: int) -> dict[str, torch.Tensor]:
        """Slice k's gradients, named as the tensor-parallel rank k names its local ones."""
        grads = {'norm.weight': self.norm.weight.grad, 'norm.bias': self.norm.bias.grad,
                 'up.weight': self.up[k].weight.grad, 'up.bias': self.up[k].bias.grad,
                 'down.weight': self.down[k].weight.grad}
        if self.down[0].bias is not None:
            grads['down.bias'] = self.down[0].bias.grad
        if self.embed is not None:
            grads['embed.weight'] = self.embed[k].weight.grad
        if self.whole_embed is not None:  # slice k's tokens, as torch.chunk (DTensor's Shard) splits them
            grads['embed.weight'] = self.whole_embed.weight.grad.chunk(TP, 0)[k]
        head = self.head[k] if isinstance(self.head, torch.nn.ModuleList) else self.head
        grads.update({'head.weight': head.weight.grad, 'head.bias': head.bias.grad})
        return grads


class SlicedLayer(torch.nn.Module):
    """worker.Layer with `up` and `down` written as their TP slices, as Sliced does for a Block."""

    def __init__(self, whole: worker.Layer) -> None:
        super().__init__()
        self.norm = whole.norm
        self.up = torch.nn.ModuleList(rows(whole.up, k) for k in range(TP))
        self.down = torch.nn.ModuleList(columns(whole.down, k) for k in range(TP))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = torch.tanh(torch.cat([part(self.norm(h)) for part in self.up], -1))
        return h + sum(part(c) for part, c in zip(self.down, u.chunk(TP, -1)))

    def local_grads(self, k: int, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + 'norm.weight': self.norm.weight.grad, prefix + 'norm.bias': self.norm.bias.grad,
                prefix + 'up.weight': self.up[k].weight.grad, prefix + 'up.bias': self.up[k].bias.grad,
                prefix + 'down.weight': self.down[k].weight.grad, prefix + 'down.bias': self.down[0].bias.grad}


def pipeline_reference(dp: int, **options) -> list[dict[tuple[int, int], dict[str, torch.Tensor]]]:
    """worker.tower() in one process, its Layers as their slices, over every replica's micro-batches: each step's
    gradients as stage s's tensor-parallel rank k names its own, under (s, k)."""
    whole = worker.tower()
    model = torch.nn.Sequential(SlicedLayer(whole[0]), SlicedLayer(whole[1]), whole[2])
    preconditioner = dkfac.KFACPreconditioner(model, accumulation_steps=worker.MICRO * dp,
                                              **dict(worker.KFAC, **options))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(worker.STEPS):
        optimizer.zero_grad()
        for replica in range(dp):
            x, y = worker.data(step, replica, 'mlp')
            for xm, ym in zip(x.chunk(worker.MICRO), y.chunk(worker.MICRO)):
                worker.loss_fn(model(xm), ym).backward()
        for p in model.parameters():
            p.grad /= worker.MICRO * dp
        preconditioner.step()
        head = {'2.weight': whole[2].weight.grad, '2.bias': whole[2].bias.grad}
        steps.append({(s, k): {name: g.clone() for name, g in
                               {**model[s].local_grads(k, f'{s}.'), **(head if s == 1 else {})}.items()}
                      for s in range(2) for k in range(TP)})
        optimizer.step()
    return steps


def reference(dp: int, kind: str, sequence_parallel: bool, vocabulary: bool = False, row_bias: bool = True,
              **options) -> list[list[dict[str, torch.Tensor]]]:
    """Each step's gradients of every slice k, from one process: every replica's batch one micro-batch, their
    gradients averaged (as the replicas average them), factors over all of them."""
    model = Sliced(worker.model(kind, row_bias), split_head=sequence_parallel, vocabulary=vocabulary)
    preconditioner = dkfac.KFACPreconditioner(model, accumulation_steps=dp, **dict(worker.KFAC, **options))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(worker.STEPS):
        optimizer.zero_grad()
        for replica in range(dp):
            worker.loss_fn(model(worker.data(step, replica, kind)[0]), worker.data(step, replica, kind)[1]).backward()
        for p in model.parameters():
            p.grad /= dp
        preconditioner.step()
        steps.append([{name: g.clone() for name, g in model.local_grads(k).items()} for k in range(TP)])
        optimizer.step()
    return steps


def whole_reference(dp: int, kind: str, sequence_parallel: bool, tp: int = TP, vocabulary: bool = False,
                    row_bias: bool = True) -> list[list[dict[str, torch.Tensor]]]:
    """As reference(), for the model itself (exact factors, or tp = 1), each step's gradients cut as slice k of
    tp holds them."""
    model = worker.model(kind, row_bias)
    preconditioner = dkfac.KFACPreconditioner(model, accumulation_steps=dp, **worker.KFAC)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The dimension each split parameter is cut along (None: whole on every rank).
    cut = {'up.weight': 0, 'up.bias': 0, 'down.weight': 1, 'embed.weight': 0 if vocabulary else 1}
    if sequence_parallel:
        cut.update({'head.weight': 0, 'head.bias': 0})
    steps = []
    for step in range(worker.STEPS):
        optimizer.zero_grad()
        for replica in range(dp):
            x, y = worker.data(step, replica, kind)
            worker.loss_fn(model(x), y).backward()
        for p in model.parameters():
            p.grad /= dp
        preconditioner.step()
        steps.append([{name: p.grad.chunk(tp, cut[name])[k].clone() if name in cut else p.grad.clone()
                       for name, p in model.named_parameters()} for k in range(tp)])
        optimizer.step()
    return steps


def check(results: list[dict], expected: list, tp: int = TP, rtol: float = 1e-10, atol: float = 1e-13) -> None:
    for rank, result in enumerate(results):
        assert 'error' not in result, result
        k = result['tp_rank']
        assert k == rank % tp
        for step in range(worker.STEPS):
            want = expected[step][k]
            assert sorted(result['grads'][step]) == sorted(want)
            for name, got in result['grads'][step].items():
                torch.testing.assert_close(got, want[name], rtol=rtol, atol=atol,
                                           msg=lambda m: f'rank {rank}, step {step}, {name}: {m}')


@pytest.mark.parametrize('dp,kind,sequence_parallel,fsdp', [
    (1, 'mlp', False, False), (2, 'mlp', False, False), (1, 'lm', False, False), (1, 'lm', True, False),
    (2, 'mlp', False, True), (2, 'lm', True, True)])
def test_tensor_parallel_slices_equal_the_sliced_model_in_one_process(dp, kind, sequence_parallel, fsdp, tmp_path):
    """dp 2 without fsdp: the replicas average their gradients as DDP would; with it, FSDP2 x TP."""
    results = run(TP * dp, {'tp': TP, 'dp': dp, 'model': kind, 'sequence_parallel': sequence_parallel, 'fsdp': fsdp},
                  tmp_path)
    expected = reference(dp, kind, sequence_parallel)
    unclipped = reference(dp, kind, sequence_parallel, kl_clip=None)
    assert any(abs(a - b).max() > 1e-3 for a, b in zip(expected[1][0].values(), unclipped[1][0].values())), \
        'KL clipping must act in this test, or a rank summing only its own slices would pass'
    check(results, expected)


@pytest.mark.parametrize('kind,sequence_parallel,strategy,vocabulary', [
    ('mlp', False, 'kaisa', False), ('lm', True, 'kaisa', False), ('lm', True, 'kaisa', True),
    ('mlp', False, 'dp', False)])
def test_owner_placement_of_the_slices_equals_the_sliced_model_in_one_process(kind, sequence_parallel, strategy,
                                                                               vocabulary, tmp_path):
    """FSDP2 x TP with sharded_placement='owner': each slice has one owner among the data-parallel ranks that shard
    it, which gathers their rows of its gradient, holds its factors and second-order state and sends the rows back;
    a row layer's bias goes from place 0's ranks to the other tensor-parallel ranks. The job is the replicated
    placement's (under KAISA the one-process model written as its slices; DP-KFAC builds each slice's factors from
    its owner's batch, under both placements). Each rank holds the state of the slices it owns alone. `vocabulary`:
    the Embedding split by its vocabulary."""
    options = {'sharded_placement': 'owner', 'strategy': strategy}
    for name in ('owner', 'replicated'):
        (tmp_path / name).mkdir()
    job = {'tp': TP, 'dp': 2, 'model': kind, 'sequence_parallel': sequence_parallel, 'fsdp': True,
           'vocabulary_parallel': vocabulary, 'row_bias': strategy != 'dp'}  # DP-KFAC: slices of one shape
    results = run(TP * 2, dict(job, options=options), tmp_path / 'owner')
    replicated = run(TP * 2, dict(job, options={'strategy': strategy}), tmp_path / 'replicated')
    check(results, [[replicated[k]['grads'][step] for k in range(TP)] for step in range(worker.STEPS)])
    if strategy == 'kaisa':
        check(results, reference(2, kind, sequence_parallel, vocabulary=vocabulary))
    row_bias = -(-worker.WIDTH // 2) * 8 if job['row_bias'] else 0  # a rank's rows of `down`'s bias, sent on
    for rank, (owner, whole) in enumerate(zip(results, replicated)):
        for result in (owner, whole):  # what the plan predicts for this data-parallel rank (the slices' shapes)
            assert result['memory']['total'] == result['predicted_memory_bytes'][rank // TP], result['memory']
            if kind == 'mlp':  # rows FSDP2 splits evenly, as the plan models them (the lm's 11-word vocabulary not)
                assert result['traffic']['gradients'][1] == worker.STEPS * (
                    result['predicted_gradient_bytes'][rank // TP] + row_bias), result['traffic']
        held = [name for name, entry in owner['state']['layers'].items() if entry]  # the slices it owns
        assert 0 < len(held) < len(owner['state']['layers']), held
        if strategy == 'kaisa':  # where the replicated placement holds every slice's state on every rank
            assert all(whole['state']['layers'].values())
            assert owner['memory']['total'] < whole['memory']['total'], (owner['memory'], whole['memory'])


@pytest.mark.parametrize('placement', ['replicated', 'owner'])
def test_hsdp_x_tensor_parallel_equals_the_sliced_model_in_one_process(placement, tmp_path):
    """HSDP x TP on 8 ranks: 2 replicas of fully_shard over 2 ranks each, over TP 2 (torchtitan's dp_replicate x
    dp_shard x tp). The 4 data-parallel ranks of each tensor-parallel place average the slice's factors; under the
    owner placement each replica's shard group has one owner per slice (KAISA's fraction 1/2)."""
    results = run(TP * 4, {'tp': TP, 'dp': 4, 'hsdp': 2, 'model': 'lm', 'options': {'sharded_placement': placement}},
                  tmp_path)
    check(results, reference(4, 'lm', False))
    if placement == 'owner':
        for result in results:
            held = [name for name, entry in result['state']['layers'].items() if entry]
            assert 0 < len(held) < len(result['state']['layers']), held


@pytest.mark.parametrize('dp,fsdp,placement', [(1, False, 'replicated'), (2, True, 'replicated'), (2, True, 'owner')])
def test_pipeline_stages_split_by_tensor_parallelism_equal_one_process(dp, fsdp, placement, tmp_path):
    """pp 2 x dp x tp 2 on one mesh, as torchtitan composes them (8 ranks with dp 2, each stage sharded by fully_shard
    over dp): each rank preconditions its stage's slices over its data-parallel group, KL clipping summed over the
    4 ranks of its replica's stages and tensor-parallel places, the head counted once. Equal to one process with the
    split layers written as their slices over the same micro-batches."""
    results = run(2 * dp * TP, {'pipeline': True, 'tp': TP, 'dp': dp, 'fsdp': fsdp,
                                'options': {'sharded_placement': placement}}, tmp_path)
    expected = pipeline_reference(dp)
    unclipped = pipeline_reference(dp, kl_clip=None)
    assert any(abs(expected[1][1, 0][name] - unclipped[1][1, 0][name]).max() > 1e-3 for name in expected[1][1, 0]), \
        'KL clipping must act in this test, or a sum missing a stage, a slice or the head once would pass'
    # How many of a stage's data-parallel ranks hold each slice's state (stage 0: up, down; stage 1: up, down, head)
    holders: dict[tuple[int, int, str], int] = {}
    for result in results:
        for name in result['held']:
            key = (result['stage'], result['tp_rank'], name)
            holders[key] = holders.get(key, 0) + 1
    assert len(holders) == TP * (2 + 3) and set(holders.values()) == {1 if placement == 'owner' else dp}, holders
    for rank, result in enumerate(results):
        assert 'error' not in result, result
        want = [expected[step][result['stage'], result['tp_rank']] for step in range(worker.STEPS)]
        for step in range(worker.STEPS):
            assert sorted(result['grads'][step]) == sorted(want[step])
            for name, got in result['grads'][step].items():
                torch.testing.assert_close(got, want[step][name], rtol=1e-10, atol=1e-13,
                                           msg=lambda m: f'rank {rank}, step {step}, {name}: {m}')


@pytest.mark.parametrize('dp,sequence_parallel,fsdp,factors', [
    (1, False, False, 'block_diagonal'), (2, True, True, 'block_diagonal'), (2, True, True, 'exact')])
def test_an_embedding_split_by_its_vocabulary_is_preconditioned_as_the_whole_layer(dp, sequence_parallel, fsdp,
                                                                                   factors, tmp_path):
    """torchtitan's split of tok_embeddings (RowwiseParallel: each rank holds some tokens' rows, 6 and 5 of the 11
    here): each rank's capture counts its tokens among the whole batch's ids, so its block of the diagonal A is the
    whole layer's, and G (from the whole output gradient) is the same on every rank: the embedding's slices are
    preconditioned exactly as the whole layer, the other split layers as their blocks (or, exact, all whole)."""
    results = run(TP * dp, {'tp': TP, 'dp': dp, 'model': 'lm', 'sequence_parallel': sequence_parallel, 'fsdp': fsdp,
                            'vocabulary_parallel': True, 'options': {'tensor_parallel_factors': factors}}, tmp_path)
    check(results, reference(dp, 'lm', sequence_parallel, vocabulary=True) if factors == 'block_diagonal'
          else whole_reference(dp, 'lm', sequence_parallel, vocabulary=True))


def test_strategy_auto_on_pipeline_stages_one_of_them_unsplit_runs_one_pick(tmp_path):
    """pp 2 x dp 2 x tp 2, stage 1 not split by tensor parallelism (its layers whole on both places; KL clipping off,
    as a stage without tensor-parallel layers needs) and strategy auto: every rank given model_parallel_group joins
    the agreement (stage 1's ranks did not, and the others waited for them), runs one pick, and stage 1's layers get
    the same gradients on both places."""
    options = {'strategy': 'auto', 'auto_recheck_steps': 0, 'kl_clip': None, 'tensor_parallel_factors': 'exact'}
    results = run(8, {'pipeline': True, 'tp': TP, 'dp': 2, 'unsplit_stage': 1, 'options': options}, tmp_path)
    picks = {line[4:34].strip() for result in results for line in result['choice'].splitlines()
             if line.startswith('  * ')}
    assert len(picks) == 1, picks
    for replica in range(2):
        places = [result for result in results if result['stage'] == 1][2 * replica:2 * replica + 2]
        for step in range(worker.STEPS):
            for name, grad in places[0]['grads'][step].items():
                assert torch.equal(grad, places[1]['grads'][step][name]), (replica, step, name)


@pytest.mark.parametrize('dp,kind,sequence_parallel,fsdp', [(1, 'lm', False, False), (2, 'lm', True, True)])
def test_exact_factors_equal_the_whole_model_in_one_process(dp, kind, sequence_parallel, fsdp, tmp_path):
    """tensor_parallel_factors='exact': every rank gathers each split layer's inputs, output gradients and
    gradient over the tensor-parallel ranks and preconditions the whole layer, as one process does."""
    results = run(TP * dp, {'tp': TP, 'dp': dp, 'model': kind, 'sequence_parallel': sequence_parallel, 'fsdp': fsdp,
                            'options': {'tensor_parallel_factors': 'exact'}}, tmp_path)
    expected = whole_reference(dp, kind, sequence_parallel)
    sliced = reference(dp, kind, sequence_parallel)
    assert any(abs(expected[1][0][name] - sliced[1][0][name]).max() > 1e-5 for name in sliced[1][0]), \
        'block-diagonal and exact factors must differ in this test'
    check(results, expected)


def test_gradients_written_in_place_are_new_gradients_and_a_repeated_step_is_still_refused(tmp_path):
    """zero_grad(set_to_none=False) and the backward pass write each DTensor gradient in place, which moves the
    DTensor's version and not its local tensor's (what the core preconditions): every step is taken as a new
    gradient (it was refused as a repeated step() at step 1), equal to one process, and a step() with no backward
    pass since the last one is still refused on every rank. Under sequence parallelism every K-FAC layer is split
    (the head too), so no layer's plain gradient shows the step to be new."""
    results = run(TP, {'tp': TP, 'dp': 1, 'sequence_parallel': True, 'zero_in_place': True, 'repeat_step': True},
                  tmp_path)
    check(results, reference(1, 'mlp', True))
    for result in results:
        assert 'step() called again on the gradients the last step() (step 9) preconditioned' in result['repeated']


@pytest.mark.parametrize('placement', ['replicated', 'owner'])
def test_a_repeated_step_on_gathered_gradients_is_refused_on_every_rank(placement, tmp_path):
    """Under fully_shard the core preconditions gradients gathered for it, new tensors at every step, so it cannot
    tell a second step() on the same gradients (they were preconditioned twice): the front end refuses it, from
    each DTensor gradient's object and version, on every rank."""
    results = run(TP * 2, {'tp': TP, 'dp': 2, 'fsdp': True, 'zero_in_place': True, 'repeat_step': True,
                           'options': {'sharded_placement': placement}}, tmp_path)
    check(results, reference(2, 'mlp', False))
    for result in results:
        assert 'step() called again on the gradients the last step() (step 9) preconditioned' in result['repeated']


@pytest.mark.parametrize('sequence_parallel,factors', [(False, 'block_diagonal'), (False, 'exact'), (True, 'exact')])
def test_a_compiled_tensor_parallel_model_equals_one_process(sequence_parallel, factors, tmp_path):
    """torch.compile (aot_eager) of the split model, its Embedding split by its vocabulary: the hooks' custom
    operators take each DTensor's local part (a type's name is not what dynamo traces; isinstance is), and dkfac's
    hook goes first in the modules' hook dicts in both of their orders (torch.compile's guards read the insertion
    order, which a prepended hook does not change). It failed at the first forward on both counts. With exact
    factors the Embedding's output gradient, traced with the output's masked-sum placement, is taken as its local
    part, the whole gradient: gathering it failed while tracing (the mask already released)."""
    options = {'tensor_parallel_factors': factors}
    results = run(TP, {'tp': TP, 'dp': 1, 'model': 'lm', 'vocabulary_parallel': True, 'compile': True,
                       'sequence_parallel': sequence_parallel, 'options': options}, tmp_path)
    check(results, reference(1, 'lm', sequence_parallel, vocabulary=True) if factors == 'block_diagonal'
          else whole_reference(1, 'lm', sequence_parallel, vocabulary=True))


@pytest.mark.parametrize('factors', ['block_diagonal', 'exact'])
def test_strategy_auto_runs_one_pick_on_every_tensor_parallel_rank(factors, tmp_path):
    """strategy='auto' with tensor parallelism: each tensor-parallel place's data-parallel group measures and
    chooses, and every place runs the pick of the first one (agreed over the tensor-parallel group: exactly one
    leading rank in each), so that the layers every place holds whole get the same gradient everywhere. The job
    equals the one-process model written as its slices under an exact pick (KAISA, SPD-KFAC), or the job given
    DP-KFAC outright. With exact factors the hooks' gathers over the tensor-parallel ranks follow the plans, which
    are the same on every place."""
    options = {'strategy': 'auto', 'auto_recheck_steps': 0, 'tensor_parallel_factors': factors}  # one choice
    row_bias = factors == 'exact'  # block-diagonal slices of one shape: no row-parallel bias (refused otherwise)
    (tmp_path / 'auto').mkdir()
    results = run(TP * 2, {'tp': TP, 'dp': 2, 'options': options, 'row_bias': row_bias}, tmp_path / 'auto')
    picks = set()
    for result in results:
        assert "the model's other parts run it too" in result['choice'] or \
            "the pick of the model's leading part" in result['choice'], result['choice']
        picks |= {line[4:34].strip() for line in result['choice'].splitlines() if line.startswith('  * ')}
    assert len(picks) == 1, picks
    if picks == {'dp'}:
        (tmp_path / 'dp').mkdir()
        dp = run(TP * 2, {'tp': TP, 'dp': 2, 'options': {'strategy': 'dp', 'tensor_parallel_factors': factors},
                          'row_bias': row_bias}, tmp_path / 'dp')
        check(results, [[dp[k]['grads'][step] for k in range(TP)] for step in range(worker.STEPS)])
    else:
        check(results, reference(2, 'mlp', False, row_bias=False) if factors == 'block_diagonal'
              else whole_reference(2, 'mlp', False))


def test_a_tensor_parallel_job_with_the_default_group_on_a_wider_world_is_refused(tmp_path):
    """process_group defaults to the world; here it holds the other tensor-parallel rank, whose factors are of
    another slice: refused, naming the ranks. With tp = world, the default means no data parallelism."""
    results = run(TP * 2, {'tp': TP, 'dp': 2, 'pass_group': False}, tmp_path)
    for result in results:
        assert 'error' in result
        assert 'split by tensor parallelism over ranks' in result['error']
        assert 'pass process_group=the data-parallel group' in result['error']
    check(run(TP, {'tp': TP, 'dp': 1, 'pass_group': False}, tmp_path), reference(1, 'mlp', False))


def test_what_cannot_be_preconditioned_is_refused_naming_the_layer(tmp_path):
    for result in run(TP, {'refusals': True}, tmp_path):
        assert "layer 'up' (Linear) takes a DTensor input" in result['split after'], result
        assert 'Build the preconditioner after parallelize_module' in result['split after']
        assert "sharded_placement='owner' with tensor_parallel_factors='exact'" in result['owner'], result
        assert 'model_parallel_group must hold the tensor-parallel ranks [0, 1]' in result['model group'], result
        assert "tensor_parallel_factors must be 'block_diagonal' or 'exact', got 'blocks'" in result['factors'], result
        assert "layer 'up' (Linear), split by torch.distributed.tensor.parallel, has its weight replicated" in \
            result['replicated'], result
        unequal = "with tensor-parallel slices whose shapes differ between the tensor-parallel ranks"
        assert f"strategy='dp' {unequal} (layer '0': slices of different sizes)" in result['dp uneven'], result
        assert f"strategy='auto' {unequal} (layer '0': slices of different sizes)" in result['auto uneven'], result
        assert (f"strategy='dp' {unequal} (layer 'down': a row-parallel layer's bias, which tensor-parallel place "
                "0's slice carries)") in result['dp row bias'], result
        assert ("the model's parts (ranks [0, 1], the tensor-parallel group) built their preconditioners differently: "
                'rank 1 has damping=0.02 where rank 0 has damping=0.01') in result['options'], result
        assert "layer '0' (Linear), split by torch.distributed.tensor.parallel, is split into slices of [1, 0] " \
               'output features' in result['empty slice'], result


def test_a_pipeline_stage_without_tensor_parallel_layers_beside_one_with_them_is_refused(tmp_path):
    """Under KL clipping a stage that holds no tensor-parallel layer would count its layers once per
    tensor-parallel rank in the sum over the model's parts (24-27% off the one-process reference): refused on every
    rank at construction, naming the ranks that hold tensor-parallel layers."""
    for result in run(4, {'stage_without_tp': True}, tmp_path):
        assert "ranks [0, 1] of the model's parts (ranks [0, 1, 2, 3]) hold tensor-parallel layers and the others " \
               'none' in result.get('error', ''), result


@pytest.mark.parametrize('placement', ['replicated', 'owner'])
def test_a_dcp_checkpoint_of_the_slices_loads_on_another_data_parallel_size(placement, tmp_path):
    """Each slice's state is saved under its own name (the tensor-parallel ranks' factors differ), and a job with
    the same tensor-parallel split and another number of replicas reads each slice's exactly. Saved under the owner
    placement, each slice's state comes from the rank that owns it."""
    path = str(tmp_path / 'checkpoint')
    (tmp_path / 'save').mkdir()
    (tmp_path / 'load').mkdir()
    saved = run(TP * 2, {'tp': TP, 'dp': 2, 'fsdp': True, 'dcp_save': path,
                         'options': {'sharded_placement': placement}}, tmp_path / 'save')
    loaded = run(TP, {'tp': TP, 'dp': 1, 'dcp_load': path}, tmp_path / 'load')
    for result in loaded:
        # What the ranks of this tensor-parallel place held: each slice's state where it is (every replica's alike
        # under the replicated placement).
        mine = [s['state'] for s in saved if s['tp_rank'] == result['tp_rank']]
        layers = {name: entry for state in mine for name, entry in state['layers'].items() if entry}
        second_order = {name: entry for state in mine for name, entry in state['dkfac']['second_order'].items()
                        if entry}
        assert sorted(result['state']['layers']) == sorted(layers)
        assert f"up (tensor-parallel slice {result['tp_rank']} of 2)" in layers and 'head' in layers
        assert placement == 'replicated' or all(len(layers) > sum(map(bool, state['layers'].values()))
                                                for state in mine), 'each owner holds a part'
        assert result['state']['steps'] == mine[0]['steps'] == worker.STEPS
        for name, entry in layers.items():
            for side, tensor in entry.items():
                assert torch.equal(result['state']['layers'][name][side], tensor), (name, side)
        assert sorted(result['state']['dkfac']['second_order']) == sorted(second_order)
        for name, entry in second_order.items():
            for key, tensor in entry.items():
                assert torch.equal(result['state']['dkfac']['second_order'][name][key], tensor), (name, key)


def test_one_tensor_parallel_rank_is_the_model_itself(tmp_path):
    """A one-rank tensor-parallel mesh: each split layer's slice is the whole layer (the GPU check runs this on a
    one-rank NCCL mesh)."""
    check(run(1, {'tp': 1, 'dp': 1}, tmp_path), whole_reference(1, 'mlp', False, tp=1), tp=1)
