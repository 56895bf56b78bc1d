"""The GPU path (marked ``gpu``; skipped with the reason when CUDA is absent, so CI stays CPU).

    pytest -m gpu tests/test_gpu.py -p no:xdist        # the README's GPU command

On one GPU: every lab script on NCCL at world size 1; the course's own collectives, DDP and
FSDP with CUDA tensors on gloo at 2 ranks sharing the GPU (received tensors land on the
right device); ``PeakMemory`` read from the CUDA allocator against the parameter bytes; chapter 12's
``OffloadPool`` on its CUDA path (side stream, events, ``record_stream``); and ``labkit doctor``. On a node with more GPUs the lab scripts also run at 2, 4 and 8 ranks on
NCCL, one GPU per rank.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import labkit
from tests.conftest import needs_solutions

ROOT = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SCRIPTS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.py"))
pytestmark = [pytest.mark.gpu, needs_solutions,
              pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU: the GPU suite runs where one is (pytest -m gpu)")]


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(list(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("world_size", [n for n in (1, 2, 4, 8, 16) if n <= max(GPUS, 1)])
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_lab_script_on_nccl(script, world_size):
    from labkit.course.labscript import world_size_error
    if world_size_error(script.name[:2], world_size):   # lab 13 at 1: a server needs a trainer
        pytest.skip(world_size_error(script.name[:2], world_size))
    proc = run(sys.executable, str(script), "--world-size", str(world_size), "--backend", "nccl")
    assert proc.returncode == 0, f"{script.name} at {world_size} on NCCL:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert "backend nccl" in proc.stdout or "nccl" in proc.stdout.lower(), proc.stdout[:500]


def _cuda_tensors_through_the_exercises() -> dict:
    from labkit.collectives import ring_all_reduce
    from labkit.ddp import DDP
    from labkit.fsdp import fully_shard
    from labkit.models import GPT, GPTConfig
    device = torch.device("cuda", 0)
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((1001,), float(rank + 1), device=device)
    ring_all_reduce(t)
    out["ring"] = (t.device.type, t[0].item(), n * (n + 1) / 2)
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    x = torch.randint(0, 32, (2, 8), device=device)
    ddp = DDP(GPT(config).to(device))
    ddp(x, x)[1].backward()
    out["ddp_grads"] = sorted({p.grad.device.type for p in ddp.parameters() if p.grad is not None})
    model = GPT(config).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model(x, x)[1].backward()
    out["fsdp_grads"] = sorted({p.grad.device.type for p in model.parameters() if p.grad is not None})
    return out


def test_cuda_tensors_through_the_exercises_on_gloo():
    """Two ranks share GPU 0 over gloo (which stages CUDA tensors through the host)."""
    for kind, value, want in (r["ring"] for r in labkit.launch(_cuda_tensors_through_the_exercises, 2,
                                                              backend="gloo", timeout=300)):
        assert kind == "cuda" and value == want
    for r in labkit.launch(_cuda_tensors_through_the_exercises, 2, backend="gloo", timeout=300):
        assert r["ddp_grads"] == ["cuda"] and r["fsdp_grads"] == ["cuda"], r


def test_peak_memory_reads_the_cuda_allocator():
    from labkit.memory import PeakMemory, param_bytes
    from labkit.models import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4)).cuda()
    with PeakMemory(model, device="cuda") as mem:
        copy = [p.detach().clone() for p in model.parameters()]  # one more copy of the parameters
    assert mem.peak_bytes >= 2 * param_bytes(model), (mem.peak_bytes, param_bytes(model))
    del copy


def test_offload_pool_cuda_path():
    """OffloadPool on CUDA (issue 34 item 5, issue 42 item 3): the copies both ways run on the
    pool's side stream, the gradients equal those without offloading, and forward leaves less on
    the device."""
    from labkit.check import assert_close
    from labkit.models import GPTConfig
    from labkit.recompute import OffloadPool, memory_gpt, offloaded_forward
    config = GPTConfig(vocab_size=32, block_size=64, n_layer=4, n_head=4, n_embd=64)
    idx = torch.randint(0, 32, (4, 65), generator=torch.Generator().manual_seed(0)).cuda()
    x, y = idx[:, :-1], idx[:, 1:]
    held = {}
    for name in ("plain", "offloaded"):
        model = memory_gpt(config).cuda()
        pool = OffloadPool(model)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for step in range(3):  # one pool over several steps
            loss = offloaded_forward(model, pool, x, y)[1] if name == "offloaded" else model(x, y)[1]
            torch.cuda.synchronize()
            held.setdefault(name, torch.cuda.memory_allocated() - before)
            model.zero_grad()
            loss.backward()
            torch.cuda.synchronize()
        held[name + "_grads"] = [p.grad.clone() for p in model.parameters()]
        held[name + "_pool"] = pool
    assert held["offloaded"] < held["plain"], held
    streams = held["offloaded_pool"].copy_streams
    assert streams and all(s != torch.cuda.current_stream() for s in streams.values()), streams
    # issue 42: every copy between host and device, forward's to the host included, on the side stream
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostDeviceCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.streams = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            devices = {a.device.type for a in args if isinstance(a, torch.Tensor)} | (
                {torch.device(kwargs["device"]).type} if kwargs.get("device") is not None else set())
            if func.__name__.startswith(("copy_", "_to_copy")) and devices == {"cpu", "cuda"}:
                self.streams.append(torch.cuda.current_stream())
            return func(*args, **(kwargs or {}))

    model, pool = memory_gpt(config).cuda(), held["offloaded_pool"]
    with HostDeviceCopies() as copies:
        loss = offloaded_forward(model, pool, x, y)[1]
        offloads = len(copies.streams)
        loss.backward()
    torch.cuda.synchronize()
    side = set(streams.values())
    assert offloads and len(copies.streams) > offloads, (offloads, len(copies.streams))
    assert all(s in side for s in copies.streams), (
        f"OffloadPool on CUDA: {sum(s not in side for s in copies.streams)} of {len(copies.streams)} host-device "
        f"copies ran outside the side stream (forward's first {offloads} are the offloads)")
    for i, (got, want) in enumerate(zip(held["offloaded_grads"], held["plain_grads"])):
        assert_close(got, want, f"OffloadPool on CUDA: gradient of parameter {i}", rtol=1e-4, atol=1e-6)


def test_doctor_measures_nccl():
    proc = run(sys.executable, "-m", "labkit.course.cli", "doctor", "--world-size", str(min(GPUS, 8)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPU 0:" in proc.stdout and "nccl" in proc.stdout and "busbw" in proc.stdout, proc.stdout
