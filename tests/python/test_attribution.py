"""Attribution: forward ops carry their module's path; backward nodes link to their forward op."""
import pytest
import torch

import gpucast
from conftest import all_cases, build

CASES = all_cases()

LEAF_OPS = {"aten::linear": torch.nn.Linear, "aten::conv2d": torch.nn.Conv2d}


def modules_by_path(model):
    root = type(model).__name__
    out = {root: model}
    for name, m in model.named_modules():
        if name:
            out[f"{root}.{name}"] = m
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_ops_carry_module_paths(name):
    model, opt, step, batch = build(CASES[name], "sgd")
    step(batch)
    with gpucast.trace() as t:
        step(batch)
    paths = modules_by_path(model)
    fwd = [o for o in t.ops if o.phase == "forward" and o.scope == "function"]
    in_model = [o for o in fwd if o.module]
    assert in_model, "no op attributed to a module"
    first, last = in_model[0].id, in_model[-1].id
    for o in fwd:
        if first <= o.id <= last and o.depth == 0:
            assert o.module, f"op #{o.id} {o.name} ran inside the model but carries no module path"
        if o.module:
            assert o.module in paths, f"op #{o.id} {o.name}: unknown module path {o.module!r}"
        if o.name in LEAF_OPS and o.depth == 0:
            # Called directly from a module's forward: that module is the layer of this kind.
            assert isinstance(paths[o.module], LEAF_OPS[o.name]), (o.name, o.module)


@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_nodes_link_to_forward_ops(name):
    model, opt, step, batch = build(CASES[name], "sgd")
    step(batch)
    with gpucast.trace() as t:
        step(batch)
    ops = t.ops
    nodes = [o for o in ops if o.scope == "backward_function"]
    assert nodes
    unlinked = 0
    for n in nodes:
        if n.seq_nr >= 0:
            assert n.fwd_op >= 0, f"backward node #{n.id} {n.name} (seq {n.seq_nr}) not linked"
            f = ops[n.fwd_op]
            assert f.seq_nr == n.seq_nr and f.thread == n.fwd_thread and f.phase == "forward"
            assert n.module == f.module
        else:
            assert n.fwd_op == -1
            unlinked += 1
    assert t.counters["unlinked_backward"] == unlinked
    assert t.counters["linked_backward"] == len(nodes) - unlinked
    assert f"{len(nodes) - unlinked} linked to their forward op, {unlinked} unlinked" in t.summary()
    # Ops run inside a backward node inherit its link.
    for o in ops:
        if o.bwd_node >= 0 and o.scope == "function":
            assert o.fwd_op == ops[o.bwd_node].fwd_op
            assert o.phase == "backward"


def test_leaf_modules_of_the_mlp():
    model, opt, step, batch = build(CASES["mlp"], "sgd")
    with gpucast.trace() as t:
        step(batch)
    paths = modules_by_path(model)
    linears = [o for o in t.ops if o.name == "aten::linear"]
    assert len(linears) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    for o in linears:
        assert isinstance(paths[o.module], torch.nn.Linear)


def test_a_light_trace_keeps_paths_and_links_without_tags_or_optimizer_hooks():
    """memory=False, record_shapes=False: what the forecast's timing iterations use. Module paths and backward
    links stay; no tagging, and no optimizer-step hooks (they would run inside the optimizer step's record)."""
    import torch.optim.optimizer as optim
    model, opt, step, batch = build(CASES["mlp"], "adamw")
    step(batch)
    hooks = (len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks))
    with gpucast.trace(memory=False, record_shapes=False) as t:
        assert (len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks)) == hooks
        step(batch)
    with gpucast.trace(memory="False"):  # the option's text form, as the C++ parser reads it
        assert len(optim._global_optimizer_pre_hooks) == hooks[0]
    with gpucast.trace() as full:
        assert len(optim._global_optimizer_pre_hooks) == hooks[0] + 1
        step(batch)
    assert t.allocations == [] and all(o.inputs == [] for o in t.ops)
    paths = sorted({o.module for o in t.ops if o.module})
    assert paths == sorted({o.module for o in full.ops if o.module}) and "MLP.net.0" in paths
    bwd = [o for o in t.ops if o.scope == "backward_function"]
    assert bwd and all(o.fwd_op >= 0 for o in bwd if o.name == "AddmmBackward0")


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_a_trace_without_nested_ops_counts_them_in_the_enclosing_op(name):
    """nested_ops=False (the forecast's timing traces): only the outermost ops of each call, backward node and
    optimizer step are recorded, plus the ops autograd links backward nodes to; the others are counted in the
    op that encloses them. The iteration's op counts, per layer and phase, equal those of a trace of every op, and
    every backward node links to the same layer."""
    from gpucast._trace import trace as Trace
    model, opt, step, batch = build(CASES[name], "adamw")
    step(batch)
    with Trace(memory=False, record_shapes=False) as every:
        step(batch)
    with Trace(memory=False, record_shapes=False, nested_ops=False) as outer:
        step(batch)
    e, o = every.result.handle, outer.result.handle
    assert o.num_ops() < e.num_ops() / 2
    assert sum(1 + x.nested for x in outer.ops) == e.num_ops() and all(x.nested == 0 for x in every.ops)
    recorded = {(x.name, x.module, x.phase) for x in outer.ops}
    for x in every.ops:
        if x.parent < 0 or x.seq_nr >= 0:  # outermost, or linked to by a backward node: recorded
            assert (x.name, x.module, x.phase) in recorded, (x.id, x.name)
    import json
    te, to = json.loads(e.iteration_timing(8)), json.loads(o.iteration_timing(8))
    for key in ("ops_total", "optimizer_ops", "other_ops"):
        assert te[key] == to[key], key
    assert [(l["layer"], l["forward_ops_all"], l["backward_ops_all"]) for l in te["layers"]] == \
           [(l["layer"], l["forward_ops_all"], l["backward_ops_all"]) for l in to["layers"]]
    nodes = lambda t: sorted((x.name, x.module) for x in t.ops if x.scope == "backward_function")
    assert nodes(outer) == nodes(every)
    assert "nested_ops" in gpucast.trace_options()


class _Catches(torch.nn.Module):
    """A forward that calls a child which raises, catches the error, then runs another child."""

    def __init__(self):
        super().__init__()
        self.bad = _Raises()
        self.good = torch.nn.Linear(4, 4)

    def forward(self, x):
        try:
            self.bad(x)
        except ValueError:
            pass
        return self.good(x)


class _Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.fail = True

    def forward(self, x):
        y = self.inner(x)
        if self.fail:
            raise ValueError("raised inside a module's forward")
        return y


@pytest.mark.parametrize("use_c", [True, False], ids=["ctypes", "dispatcher"])
def test_module_scopes_close_after_an_exception(use_c):
    """The post hooks run on a normal return only: an exception's open module entries are closed by the next
    post hook of an enclosing module, or by the next call of the outermost module (a training loop that catches
    the error and runs the model again). Both ways of calling the library (its C entry points through ctypes,
    the dispatcher ops as the fallback) attribute the same."""
    from gpucast import _trace
    code, push, pop = _trace._module_calls(use_c)
    import ctypes
    assert isinstance(push, ctypes._CFuncPtr) == use_c  # the library's symbols are reachable here
    assert code("_Catches.good") == -1  # no trace running: no code, and pushes and pops do nothing
    push(4)
    pop()
    old = _trace._module_calls
    _trace._module_calls = lambda: old(use_c)
    try:
        m = _Catches()
        r = _Raises()
        x = torch.ones(2, 4)
        with gpucast.trace(memory=False) as t:
            m(x)
            with pytest.raises(ValueError):
                r(x)  # the outermost module raises: its entry stays open until it is called again
            r.fail = False
            r(x)
            m(x)
            torch.relu(x)  # outside every module
    finally:
        _trace._module_calls = old
    linears = [(o.module) for o in t.ops if o.name == "aten::linear"]
    assert linears == ["_Catches.bad.inner", "_Catches.good", "_Raises.inner", "_Raises.inner",
                       "_Catches.bad.inner", "_Catches.good"]
    assert [o.module for o in t.ops if o.name == "aten::relu"] == [""]


def two_roots():
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    disc = torch.nn.Sequential(torch.nn.Linear(8, 1))
    return gen, disc, torch.nn.ModuleDict({"G": gen, "D": disc})


def linear_modules(t):
    return [op.module for op in t.result.ops if op.name == "aten::linear"]


def test_modules_called_outside_any_other_are_named_apart():
    gen, disc, _ = two_roots()
    with gpucast.trace() as t:
        disc(gen(torch.ones(2, 4)))
        disc(torch.ones(2, 8))
        gen[0](torch.ones(2, 4))  # a submodule of a root called before: its path there
    assert linear_modules(t) == ["Sequential.0", "Sequential#2.0", "Sequential#2.0", "Sequential.0"]


def test_the_model_names_the_modules_called_outside_it():
    gen, disc, model = two_roots()
    with gpucast.trace(model=model) as t:
        disc(gen(torch.ones(2, 4)))
    assert linear_modules(t) == ["ModuleDict.G.0", "ModuleDict.D.0"]
    with pytest.raises(ValueError, match=r"^gpucast.trace: model should be a torch.nn.Module, got str$"):
        gpucast.trace(model="ModuleDict")
