"""What an exercise may not use: PyTorch's own implementation of the technique it builds.

One table, checked before every graded test: a task fails when its chapter's module names a
forbidden API anywhere (an import, an attribute such as ``dist.all_reduce``, a
``getattr(dist, "all_reduce")`` or ``importlib.import_module("torch.distributed.pipelining")``),
with a message naming the name and the line. The tests themselves use these built-ins as
oracles; the rule is about the learner's module only. Other chapters' modules
(``labkit.tp`` inside ``labkit.sp``), the course's tools (``labkit.comm``, ``labkit.models``)
and the building blocks each chapter is about (send/recv in chapter 00, all-reduce in
DDP, all-to-all in Ulysses) stay allowed.

A name is forbidden when it equals an entry or lies below it (``torch.distributed.tensor``
forbids ``torch.distributed.tensor.parallel.ColwiseParallel``).

``check`` then applies the submission policy (``labkit.course.policy``: the imports a chapter
allows, no dynamic access that would defeat this table) to the module and to every exercise
module it imports; the policy also resolves names through the real modules, so a built-in
reached as ``labkit.models.torch.distributed.all_reduce`` is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

_COLLECTIVES = tuple(f"torch.distributed.{name}" for name in (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_coalesced", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather",
    "scatter", "_all_gather_base", "_reduce_scatter_base", "_functional_collectives", "nn"))
_DDP = ("torch.nn.parallel", "torch.nn.DataParallel", "torch.distributed.algorithms",
        "torch.distributed._composable")
_FSDP = ("torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.FullyShardedDataParallel",
         "torch.distributed.fsdp.FSDPModule", "torch.distributed.fsdp._fully_shard",
         "torch.distributed.fsdp.fully_sharded_data_parallel")

# chapter module -> (forbidden names, why): the PyTorch implementation of what it builds.
FORBIDDEN: dict[str, tuple[tuple[str, ...], str]] = {
    "collectives": (_COLLECTIVES, "chapter 00 builds the collectives from send/recv"),
    "dp": (_DDP + ("torch.utils.data.DistributedSampler", "torch.distributed.rpc"),
           "chapter 01 builds sampling, averaging, DataParallel and the parameter server"),
    "ddp": (_DDP + _FSDP + ("torch.distributed._broadcast_coalesced", "torch.distributed.utils",
                            "torch.distributed._compute_bucket_assignment_by_size", "torch.distributed.Reducer"),
            "chapter 02 builds DistributedDataParallel"),
    "zero": (("torch.distributed.optim",) + _DDP + _FSDP, "chapter 03 builds ZeroRedundancyOptimizer"),
    "fsdp": (_FSDP + _DDP + ("torch.distributed.tensor", "torch.distributed.optim"),
             "chapter 04 builds fully_shard"),
    "tp": (("torch.distributed.tensor", "torch.distributed.nn", "torch.distributed._functional_collectives"),
           "chapter 05 builds tensor parallelism (parallelize_module, DTensor and loss_parallel are the oracles)"),
    "pp": (("torch.distributed.pipelining",), "chapter 06 builds the pipeline schedules"),
    "sp": (("torch.distributed.tensor", "torch.distributed.nn", "torch.distributed._functional_collectives"),
           "chapter 07 builds sequence and context parallelism (context_parallel and SequenceParallel are the oracles)"),
    "mesh": (("torch.distributed.device_mesh", "torch.distributed.tensor", "torch.distributed.pipelining",
              "torch.nn.parallel") + _FSDP, "chapter 08 builds the rank grid and composes your own parts"),
    "elastic": (("torch.distributed.checkpoint",), "chapter 09 builds the checkpoint (DCP is the oracle)"),
    "moe": (("torch.distributed.nn", "torch.distributed._functional_collectives", "torch.distributed.tensor",
             "torch.distributed.device_mesh", "torch.nn.parallel"),
            "chapter 10 builds the all-to-all dispatch with its autograd (dist.all_to_all_single is the building block) "
            "and EP x DP on your chapter-08 rank grid"),
    "compress": (("torch.distributed.algorithms",),
                 "chapter 11 builds the compression hooks (torch's ddp_comm_hooks are the oracles)"),
    "recompute": (("torch.utils.checkpoint", "torch.autograd.graph.save_on_cpu", "torch.distributed.fsdp",
                   "torch.distributed.algorithms", "torch.nn.parallel"),
                  "chapter 12 builds recomputation, offloading and accumulation (torch.utils.checkpoint, "
                  "save_on_cpu, CPUOffloadPolicy and no_sync are the oracles)"),
    "rpc": (_COLLECTIVES + _DDP + ("torch.distributed.send", "torch.distributed.recv", "torch.distributed.isend",
                                   "torch.distributed.irecv", "torch.distributed.batch_isend_irecv",
                                   "torch.distributed.pipelining", "torch.distributed.nn.api.remote_module"),
            "chapter 13 builds its servers and pipeline on RPC alone (no collectives or send/recv; "
            "RemoteModule and torch.distributed.pipelining are not the exercise)"),
    "perf": (("torch.utils.flop_counter", "torch.utils.benchmark", "torch.cuda.get_device_properties"),
             "chapter 14 predicts FLOPs and time from arithmetic (FlopCounterMode is the oracle the "
             "tests count with; nothing may be measured or looked up at run time)"),
}


def forbidden_uses(module: str, source: str, filename: str = "") -> list[str]:
    """'labkit/pp.py:12: torch.distributed.pipelining.ScheduleGPipe' for each forbidden use."""
    banned = FORBIDDEN.get(module, ((), ""))[0]
    if not banned:
        return []
    filename = filename or f"labkit/{module}.py"
    found = []
    for line, name in _dotted_names(ast.parse(source)):
        if any(name == b or name.startswith(b + ".") for b in banned):
            found.append(f"{filename}:{line}: {name}")
    return sorted(set(found), key=lambda s: int(s.split(":")[1]))


def check(task_id: str, source: str, filename: str = "") -> None:
    """Raise AssertionError naming every forbidden name the task's module uses (the policy's
    checks come on top: ``labkit.course.policy.check_task``, which every graded test runs).
    ``filename``: the file ``source`` is, when the chapter is a package of several."""
    module = task_id.split(".")[0]
    filename = filename or f"labkit/{module}.py"
    uses = forbidden_uses(module, source, filename)
    if uses:
        why = FORBIDDEN[module][1]
        raise AssertionError(
            f"{task_id}: {filename} uses PyTorch's own implementation of what it is asked to "
            f"build ({why}): " + "; ".join(uses) + ". Build it from the chapter's parts instead.")


def check_file(task_id: str, path: Path) -> None:
    check(task_id, path.read_text())


def _dotted_names(tree: ast.AST):
    """(line, fully qualified name) for every import, attribute chain, and string named to
    ``getattr``/``import_module``/``__import__``, resolved through the module's import aliases."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                yield node.lineno, f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            name = _resolve(node, aliases)
            if name:
                yield node.lineno, name
        elif isinstance(node, ast.Call) and node.args:
            fn = _resolve(node.func, aliases) or ""
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if fn.endswith(("import_module", "__import__")) and strings:
                yield node.lineno, strings[0]
            elif fn == "getattr" and len(node.args) >= 2 and strings:
                base = _resolve(node.args[0], aliases)
                if base:
                    yield node.lineno, f"{base}.{strings[0]}"


def _resolve(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = aliases.get(node.id, node.id if node.id in ("getattr", "__import__") else None)
    if head is None:
        return None
    return ".".join([head, *reversed(parts)])
