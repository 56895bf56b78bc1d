"""The contract layer (labkit.runtime.contracts, catalogue in labkit.course.contracts): what it
catches, what it lets through, and that it runs around every exercise call while grading."""

import inspect
import json
import random
import types

import pytest
import torch
import torch.distributed as dist

from labkit.course import contracts as catalogue
from labkit.course.chapters import CHAPTERS
from labkit.runtime import contracts
from labkit.runtime.worker import OVERRIDES_ENV

SOURCE = '''
import random, torch
from torch import nn

def accumulate(out, x):
    out += x                     # declared: writes out
    return out

def sneaky_sum(x, y):
    x += y                       # writes its input, undeclared
    return x

def undo(x):
    x.add_(1); x.sub_(1)         # same values, but written in place
    return x.clone()

def reseed(n):
    torch.manual_seed(0)
    return torch.randperm(n)

def draws_python(n):
    return random.random()

def declared_draw(n):
    return torch.rand(n)

def rebinding_accumulate(out, x):
    out.set_(out + x)            # a new storage under the caller's tensor
    return out

def gather_into(output, input):
    output.copy_(torch.cat([input, input]))   # input is a view of output: in place is allowed

def total(tensors):
    tensors[0].mul_(2)           # a tensor inside a list argument
    return sum(t.sum() for t in tensors)

def shuffled(n):
    yield from torch.randperm(n).tolist()

_plans = {}
def planned(x):
    if x.shape not in _plans:       # a cache the next call reads: state between calls
        _plans[x.shape] = x.numel()
    return x * _plans[x.shape]

def remembered(x, seen=[]):
    seen.append(x.shape)
    return x.clone()

class Planner:
    plans = {}
    def plan(self, n):
        self.plans.setdefault(n, n)   # a class-level cache, shared by every instance
        return n
    def keep(self, n):
        self.last = n                 # the object's own state: fine
        return n

def widened(x):
    return x.float() * 2            # bf16 in, float32 out

def exact_sum(x):
    return x.double().sum().to(x.dtype)   # wider inside, the input's dtype out

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)    # initial weights from the global generator: allowed
    def forward(self, x):
        return nn.functional.dropout(self.lin(x), 0.5)

class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
    def forward(self, x):
        return self.lin(x.double())   # float64 parameters: a float64 output is the module's

class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x
    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(2)       # writes the incoming gradient in place
'''


@pytest.fixture
def fake():
    """A module labkit.fakeex wrapped under a spec of its own (the real one restored after)."""
    saved = contracts._spec
    module = types.ModuleType("labkit.fakeex")
    exec(compile(SOURCE, "fakeex.py", "exec"), module.__dict__)
    for value in vars(module).values():
        if inspect.isfunction(value) or inspect.isclass(value):
            value.__module__ = "labkit.fakeex"
    contracts._spec = dict(modules=["fakeex"], mode="raise", init_may_consume=True, declared={
        "fakeex.accumulate": dict(writes=["out"], consumes=[]),
        "fakeex.declared_draw": dict(writes=[], consumes=["rng"]),
        "fakeex.gather_into": dict(writes=["output"], consumes=[]),
        "fakeex.rebinding_accumulate": dict(writes=["out"], consumes=[])})
    contracts.wrap_module(module)
    yield module
    contracts._spec = saved


def test_declared_write_passes_undeclared_fails(fake):
    out, x = torch.zeros(3), torch.ones(3)
    fake.accumulate(out, x)
    assert out.tolist() == [1, 1, 1] and x.tolist() == [1, 1, 1]
    with pytest.raises(contracts.ContractError, match=r"labkit.fakeex.sneaky_sum: changed its argument 'x' \(its values"):
        fake.sneaky_sum(torch.ones(2), torch.ones(2))


def test_in_place_result_lands_in_the_callers_memory(fake):
    with pytest.raises(contracts.ContractError, match="replaced the memory or shape of 'out'"):
        fake.rebinding_accumulate(torch.zeros(3), torch.ones(3))


def test_in_place_undone_is_still_caught(fake):
    with pytest.raises(contracts.ContractError, match="written in place"):
        fake.undo(torch.ones(2))


def test_module_state_between_calls(fake):
    with pytest.raises(contracts.ContractError, match=r"planned: changed state that outlives the call \(_plans\)"):
        fake.planned(torch.ones(2))


def test_state_in_defaults_and_class_attributes(fake):
    with pytest.raises(contracts.ContractError, match=r"remembered: .*\(default argument 0\)"):
        fake.remembered(torch.ones(2))
    planner = fake.Planner()
    assert planner.keep(3) == 3
    with pytest.raises(contracts.ContractError, match=r"Planner.plan: .*\(class attribute of Planner plans\)"):
        planner.plan(3)


def test_floating_results_keep_the_input_dtype(fake):
    assert fake.exact_sum(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(contracts.ContractError, match="widened: returned torch.float32 for torch.bfloat16 inputs"):
        fake.widened(torch.ones(3, dtype=torch.bfloat16))


def test_a_modules_output_follows_its_parameters(fake):
    assert fake.Wide()(torch.ones(2, 3)).dtype == torch.float64


def test_tensor_inside_a_list(fake):
    with pytest.raises(contracts.ContractError, match=r"'tensors\[0\]'"):
        fake.total([torch.ones(2), torch.ones(2)])


def test_global_generators(fake):
    with pytest.raises(contracts.ContractError, match="torch's global generator"):
        fake.reseed(5)
    with pytest.raises(contracts.ContractError, match="Python's random"):
        fake.draws_python(1)
    state = torch.get_rng_state()
    fake.declared_draw(3)  # declared: allowed, and it did draw
    assert not torch.equal(state, torch.get_rng_state())


def test_generator_checked_per_item(fake):
    items = fake.shuffled(4)   # nothing drawn yet: the check runs while it is iterated
    with pytest.raises(contracts.ContractError, match="torch's global generator"):
        list(items)


def test_aliasing_in_place_output(fake):
    output = torch.zeros(4)
    fake.gather_into(output, output[:2])   # input lives inside output, which is declared written


def test_module_init_may_draw_forward_may_not(fake):
    net = fake.Net()
    with pytest.raises(contracts.ContractError, match="Net.forward: changed the state of torch's global"):
        net(torch.ones(2, 3))


def test_backward_may_not_write_the_incoming_gradient(fake):
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(contracts.ContractError, match=r"Scale.backward: changed its argument 'grad'"):
        fake.Scale.apply(x).backward(torch.ones(3))


def test_suspended_and_record_mode(fake, tmp_path):
    with contracts.suspended():
        fake.sneaky_sum(torch.ones(2), torch.ones(2))
    log = tmp_path / "c.log"
    contracts._spec = dict(contracts._spec, mode=f"record:{log}")
    fake.reseed(3)
    assert json.loads(log.read_text())["call"] == "fakeex.reseed"


def test_graded_tests_export_it_to_their_ranks_and_others_do_not():
    """Notebooks and labs run by the suite are measured as a learner runs them: only the
    launches of graded tests carry the checks to their ranks."""
    import os
    assert contracts.CONTRACTS_ENV not in os.environ


def test_grading_installs_it_here():
    """The grading plugin turned it on for this process: exercises imported now are wrapped."""
    from labkit import collectives
    assert contracts.active()
    assert collectives.ring_all_reduce.__labkit_contract__ == "collectives.ring_all_reduce"


BROKEN_GATHER = '''
import torch, torch.distributed as dist
def ring_all_gather(output, input, group=None):
    dist.all_gather_into_tensor(output, input, group=group)
    input.zero_()                               # right output, the caller's input wiped
'''


def broken_gather_on_rank():
    from labkit.collectives import ring_all_gather
    mine = torch.full((3,), float(dist.get_rank()))
    output = torch.empty(3 * dist.get_world_size())
    ring_all_gather(output, mine)


def test_every_rank_is_checked(tmp_path, monkeypatch):
    """Ranks install the layer from the environment the grader sets around a graded test: a
    wrong implementation loaded into the ranks (as mutation testing does) fails there."""
    from labkit.launch import WorkerError, launch
    path = tmp_path / "collectives.py"
    path.write_text(BROKEN_GATHER)
    monkeypatch.setenv(OVERRIDES_ENV, json.dumps({"collectives": str(path)}))
    monkeypatch.setenv(contracts.CONTRACTS_ENV, json.dumps(catalogue.spec()))  # as around a graded test
    with pytest.raises(WorkerError, match="ContractError.*ring_all_gather: changed its argument 'input'"):
        launch(broken_gather_on_rank, 2, timeout=60)


def test_catalogue_names_real_callables_and_arguments():
    """Every declaration names a callable that exists and arguments it has: a typo would be
    a silent exemption."""
    import importlib
    for name, declared in catalogue.CATALOGUE.items():
        module, *path = name.split(".")
        assert module in CHAPTERS.values(), name
        target = importlib.import_module(f"labkit.{module}")
        for part in path:
            target = getattr(target, part)
        parameters = inspect.signature(inspect.unwrap(target)).parameters
        for argument in declared.writes:
            assert argument in parameters, f"{name} declares it writes {argument!r}, which it does not take"
        assert set(declared.consumes) <= {"rng"} and declared.why, name


def test_labkit_tasks_prints_the_catalogue():
    """A learner sees what each exercise may write or consume before the grader says so."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "labkit.course.cli", "tasks", "--contracts", "00"],
                         capture_output=True, text=True, check=True).stdout
    for name, declared in catalogue.CATALOGUE.items():
        if name.startswith("collectives."):
            assert name in out and declared.why in out, out
    assert "compress." not in out
