"""torch.compile: a model dkfac hooks compiles the graphs it compiles without K-FAC, one forward and one backward
graph for factor and non-factor steps alike, with no graph break; its capture runs inside them (two custom
operators per layer, dkfac::capture_input in the forward graph and dkfac::capture_output_grad in the backward
graph, each once), and it trains to the eager model's K-FAC gradients. (The hooks used to call the C++ capture
directly: Dynamo gave up on the whole forward, and a hooked model compiled nothing.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import dkfac


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def train(model: torch.nn.Module, *, compiled: object | None, kfac: bool, steps: int = 6):
    """Losses and the gradients each step() left, over `steps` steps (factor steps every 2, inverse every 4)."""
    preconditioner = (dkfac.KFACPreconditioner(model, kl_clip=None, factor_update_steps=2, inv_update_steps=4)
                      if kfac else None)
    run = torch.compile(model, backend=compiled) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        loss = run(x).pow(2).mean()
        loss.backward()
        if preconditioner is not None:
            preconditioner.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


class Recorder:
    """An aot_eager backend that keeps every forward and backward graph AOTAutograd compiles."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: dict[str, list[torch.fx.GraphModule]] = {'forward': [], 'backward': []}

        def keep(kind: str):
            def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
                self.graphs[kind].append(gm)
                return make_boxed_func(gm.forward)
            return compiler

        self.backend = aot_autograd(fw_compiler=keep('forward'), bw_compiler=keep('backward'))

    def calls(self, kind: str, name: str) -> int:
        """How many nodes of `kind`'s graphs call `name` (directly, or functionalized)."""
        count = 0
        for gm in self.graphs[kind]:
            for node in gm.graph.nodes:
                if node.op == 'call_function' and (name in str(node.target) or
                                                   any(name in str(a) for a in node.args if callable(a))):
                    count += 1
        return count

    def operators(self, kind: str) -> list[str]:
        """The operators `kind`'s graphs call, in order, the captures' own left out."""
        return [str(node.target) for gm in self.graphs[kind] for node in gm.graph.nodes
                if node.op == 'call_function' and 'dkfac' not in str(node.target) and
                not any('dkfac' in str(a) for a in node.args if callable(a)) and 'getitem' not in str(node.target)]


def test_a_hooked_model_compiles_the_graphs_it_compiles_without_kfac():
    from torch._dynamo.utils import counters

    results = {}
    for kfac in (False, True):
        torch._dynamo.reset()
        counters.clear()
        recorder = Recorder()
        train(make_model(), compiled=recorder.backend, kfac=kfac)
        results[kfac] = recorder
        assert sum(counters['graph_break'].values()) == 0, dict(counters['graph_break'])
        # One graph each way for all six steps: factor steps (0, 2, 4) and the others share it, no recompile.
        assert len(recorder.graphs['forward']) == 1 and len(recorder.graphs['backward']) == 1, recorder.graphs
        assert counters['stats']['unique_graphs'] == 1
    plain, hooked = results[False], results[True]
    assert hooked.calls('forward', 'capture_input') == 3  # one per Linear layer, in the forward graph only
    assert hooked.calls('backward', 'capture_input') == 0
    assert hooked.calls('backward', 'capture_output_grad') == 3
    assert hooked.calls('forward', 'capture_output_grad') == 0
    assert plain.calls('forward', 'capture_input') == 0
    # The model's own operators are the same with and without K-FAC, but for one detach of each layer's output
    # (the output passed on by _CapturedOutput; an alias, it copies nothing).
    assert hooked.operators('backward') == plain.operators('backward')
    extra = list(hooked.operators('forward'))
    for operator in plain.operators('forward'):
        extra.remove(operator)
    assert extra == ['aten.detach.default'] * 3, extra


@pytest.mark.parametrize('backend', ['aot_eager', 'inductor'])
def test_a_compiled_model_trains_to_the_eager_models_kfac_gradients(backend):
    torch._dynamo.reset()
    eager_losses, eager = train(make_model(), compiled=None, kfac=True)
    compiled_losses, compiled = train(make_model(), compiled=backend, kfac=True)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-8)
    for step, (got, expected) in enumerate(zip(compiled, eager)):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f'step {step}')
    _, plain = train(make_model(), compiled=None, kfac=False)
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in zip(eager[1], plain[1])), \
        'K-FAC changed nothing: the comparison could not fail'


def test_a_compiled_model_captures_each_pass_once():
    """Each compiled forward and backward feeds each layer's capture once (a second capture of A, from a copy of
    the operator in the backward graph, would show as two passes, and warn)."""
    torch._dynamo.reset()
    model = make_model()
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1)
    run = torch.compile(model, backend='aot_eager')
    run(torch.randn(32, 8)).pow(2).mean().backward()
    assert [(c.a_count, c.g_count) for c in preconditioner._captures] == [(1, 1)] * 3
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        preconditioner.step()


def kfac_gradients(make: Callable[[], torch.nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]],
                   loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], compiled: str | None,
                   dynamic: bool | None = None) -> list[list[torch.Tensor]]:
    """The gradients each step() left over `batches`, the model (float64, float64 second-order state) run eagerly or
    compiled by `compiled` (factor steps every step, inverse steps every 2)."""
    model = make().double()
    preconditioner = dkfac.KFACPreconditioner(model, kl_clip=None, factor_update_steps=1, inv_update_steps=2,
                                              inv_dtype=torch.float64)
    run = torch.compile(model, backend=compiled, dynamic=dynamic) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x, y in batches:
        loss(run(x), y).backward()
        preconditioner.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return grads


def assert_steps_close(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]], **tolerance: float) -> None:
    for step, (a_step, b_step) in enumerate(zip(got, expected, strict=True)):
        for a, b in zip(a_step, b_step, strict=True):
            torch.testing.assert_close(a, b, **tolerance, msg=f'step {step}')


def features(shapes: list[tuple[int, ...]], outputs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Float64 inputs of each shape (the last dimension the features) and class targets of the rows."""
    batches = []
    for step, shape in enumerate(shapes):
        generator = torch.Generator().manual_seed(step)
        batches.append((torch.randn(shape, generator=generator, dtype=torch.float64),
                        torch.randint(0, outputs, shape[:-1], generator=generator)))
    return batches


class Sequences(torch.nn.Module):
    """An Embedding, a Conv1d and two Linear layers over token sequences."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.conv = torch.nn.Conv1d(16, 16, 3, padding=1)
        self.hidden = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(x).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(self.hidden(h)))


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


@pytest.mark.parametrize('backend,dynamic', [('aot_eager', None), ('aot_eager', True), ('inductor', None)])
def test_a_compiled_model_given_other_shapes_each_step_trains_to_the_eager_models_kfac_gradients(backend, dynamic):
    """Batch sizes and sequence lengths that change (the last batch of an epoch, padding to each batch's longest):
    the graph is compiled again with dynamic shapes (automatically at the second shape, or from the start). The
    output gradient's capture is a function applied to the output in the compiled forward; as a tensor hook
    registered there, Dynamo failed to compile it once a shape was dynamic (`Node autograd_function_apply
    referenced nonexistent value s77`)."""
    torch._dynamo.reset()
    batches = [(tokens, tokens % 5) for tokens in
               (torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(step))
                for step, shape in enumerate([(8, 12), (6, 12), (5, 9), (8, 7), (3, 12), (7, 5)]))]
    eager = kfac_gradients(Sequences, batches, token_loss, None)
    compiled = kfac_gradients(Sequences, batches, token_loss, backend, dynamic)
    assert_steps_close(compiled, eager, **({'rtol': 1e-10, 'atol': 1e-13} if backend == 'aot_eager'
                                           else {'rtol': 1e-9, 'atol': 1e-12}))


class Checkpointed(torch.nn.Module):
    """Two residual blocks run under activation checkpointing (no reentrance), and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(2))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_an_inductor_compiled_model_under_activation_checkpointing_trains_to_the_eager_models_kfac_gradients():
    """Under activation checkpointing inductor's memory plan reuses a layer's input buffer once the forward is done
    with it, whatever else references it: the capture, which kept the input to build its A factor when the output
    gradient came, built it from whatever the buffer held by then (gradients 1e-2 off). A compiled graph's input is
    now built into its factor at once."""
    torch._dynamo.reset()
    batches = features([(8, 16)] * 4, 5)
    loss = torch.nn.functional.cross_entropy
    eager = kfac_gradients(Checkpointed, batches, loss, None)
    compiled = kfac_gradients(Checkpointed, batches, loss, 'inductor')
    assert_steps_close(compiled, eager, rtol=1e-9, atol=1e-12)


class WrittenInPlace(torch.nn.Module):
    """Registered layers whose outputs the next operation writes in place: ReLU(inplace=True) (torchvision's VGG and
    AlexNet) and an in-place residual sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(8, 8)
        self.relu = torch.nn.ReLU(inplace=True)
        self.second = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.first(x))
        y = self.second(h)
        y += h
        return self.head(y.mul_(0.5))


@pytest.mark.parametrize('backend', ['aot_eager', 'inductor'])
def test_a_compiled_model_that_writes_a_layers_output_in_place_trains_to_the_eager_models_kfac_gradients(backend):
    """The compiled capture passes each layer's output on detached, not as a view: autograd forbids an in-place write
    to a custom function's view (`Output 0 of ApplyTemplateBackward is a view and is being modified inplace`),
    which failed these models' compilation, as the tensor hook before it did."""
    torch._dynamo.reset()
    batches = features([(16, 8)] * 4, 4)
    loss = torch.nn.functional.cross_entropy
    eager = kfac_gradients(WrittenInPlace, batches, loss, None)
    compiled = kfac_gradients(WrittenInPlace, batches, loss, backend)
    assert_steps_close(compiled, eager, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize('backend', ['eager', 'aot_eager'])
def test_an_embedding_resized_in_place_under_a_compiled_graph_is_refused_naming_it(backend):
    """A weight resized in place (resize_token_embeddings' larger .data) under a graph compiled before: no guard
    sees it, and the graph runs on. The capture's operator refuses, naming the layer, as the eager hook does; it
    failed with a bare `IndexError: index out of range in self` from the capture."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 3))
    preconditioner = dkfac.KFACPreconditioner(model, factor_update_steps=1)
    run = torch.compile(model, backend=backend)
    run(torch.randint(0, 16, (2, 5))).sum().backward()
    preconditioner.step()
    model.zero_grad()
    with torch.no_grad():
        model[0].weight.data = torch.cat([model[0].weight, torch.randn(8, 4)])
    message = r"layer '0' \(Embedding\): its weight is \[24, 4\] now, \[16, 4\] when the preconditioner was built"
    with pytest.raises(ValueError, match=message):
        run(torch.full((2, 5), 20)).sum().backward()


def test_the_capture_operators_are_kept_out_of_cuda_graphs():
    """mode='reduce-overhead' records CUDA graphs; a replay would run the kernels a capture launched while being
    recorded, not the capture (no factor would take the new batch). Both operators carry the tag by which
    inductor runs an operator between its CUDA graphs (its graph partitions), as torch's own check reads it."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    graph = torch.fx.Graph()
    x = graph.placeholder('x')
    for op in (torch.ops.dkfac.capture_input.default, torch.ops.dkfac.capture_output_grad.default):
        assert torch.Tag.cudagraph_unsafe in op.tags, op.tags
        node = graph.call_function(op, (x, x, 0) if 'input' in str(op) else (x, 0))
        assert is_cudagraph_unsafe_fx_node(node), op
