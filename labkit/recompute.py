"""Chapter 12 exercises: memory. Activation recomputation, activation offloading, accumulation.

Backward needs tensors from forward: the input of every matmul, the output of every softmax,
the mask of every dropout. Autograd keeps them ("saved tensors") from the moment forward makes
them until backward uses them, so at the end of forward every layer's are alive at once: the
activation memory of a step, which grows with layers x batch x sequence (and x sequence^2 for
attention scores). Three ways to hold less:

* **Recomputation** (Chen et al., 2016, arXiv:1604.06174): keep only a block's input; in
  backward run the block's forward again, this time recording, and backpropagate through it.
  One extra forward per checkpointed block buys back all of its saved tensors but its input.
  Dropout must draw the same mask twice: the RNG state is saved before the forward and
  restored for the recomputation.
* **Selective recomputation** (Korthikanti et al., 2022, arXiv:2205.05198): most of a block's
  activation bytes at long sequences are attention's a x s x s scores, softmax and dropout
  mask, which are cheap to recompute (no weights, few FLOPs). Keep the matmul outputs,
  recompute only the core ``softmax(q k^T / sqrt(d) + causal) -> dropout -> @ v``.
* **Offloading** (as in ZeRO-Offload/ZeRO-Infinity and torch's ``save_on_cpu``): the tensors
  autograd saves go to host memory as forward makes them (``saved_tensors_hooks``: *pack*
  runs when a tensor is saved, *unpack* when backward needs it) and come back in backward,
  the next layer's transfer started before backward reaches it (prefetch).
* **Gradient accumulation**: m micro-batches one after another, gradients summed in place;
  activations of one micro-batch at a time. The loss of each (a mean over its tokens) is
  weighted by its share of the tokens (1/m when the micro-batches are equal) so the sum is the
  mean over every token of the whole batch, even when micro-batches differ in size; data-parallel
  ranks average gradients once, after the last micro-batch (chapter 02's ``no_sync``).
* **Optimizer offloading** (ZeRO-Offload): the fp32 master weights and Adam's moments, 12 of the
  16 bytes per parameter of mixed-precision training, on the host; the update runs there.

The course GPT (``labkit.models``) has no dropout and calls fused attention; this chapter's
``MemoryBlock`` is the same block (same weights) written out op by op, with dropout, so that
every saved tensor is visible and countable (``SavedTensors``; ``block_saved_bytes`` is the chapter's
formula).

Tasks (run ``labkit grade recompute``; tests in ``tests/grading/test_recompute.py``):
    recompute.checkpoint  Checkpoint (an autograd.Function), checkpoint_every (the policy)
    recompute.segments    checkpoint_segments: Chen's segments of k blocks, one checkpoint each (sqrt(L) memory)
    recompute.selective   causal_attention(..., selective=True): the core recomputed in backward
    recompute.offload     OffloadPool: pack, unpack, prefetch
    recompute.accumulate  accumulate: token-weighted micro-batches, one all-reduce per parameter at the end
    recompute.optimizer_offload  OffloadedAdamW: fp32 master and moments on the host, 16-bit on the device
    recompute.chunked_ce  chunked_cross_entropy: the LM loss over chunks of rows, logits recomputed in backward
Bad input (k < 1, no micro-batches, a dropout probability outside [0, 1), an optimizer without
parameters) raises ValueError before anything runs.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.models import GPT, Block, GPTConfig


# ----------------------------------------------------------------------------- the block, op by op

class MemoryBlock(Block):
    """``labkit.models.Block`` (same parameters, same names) with dropout after attention's
    softmax and after each residual branch, attention written out (no fused kernel). With
    ``selective`` the attention core is recomputed in backward instead of kept."""

    def __init__(self, config: GPTConfig, dropout: float = 0.0, selective: bool = False):
        super().__init__(config)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"recompute: dropout probability must be in [0, 1), got {dropout}")
        self.dropout, self.selective, self.n_head = dropout, selective, config.n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.reshape(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, p, self.selective)
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + F.dropout(self.attn.c_proj(y), p)
        x = x + F.dropout(self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)))), p)
        return x


def memory_gpt(config: GPTConfig, dropout: float = 0.0, selective: bool = False, seed: int = 0) -> GPT:
    """The course GPT with every block a ``MemoryBlock``: the same weights as ``GPT(config, seed)``."""
    gpt = GPT(config, seed=seed)
    for i, block in enumerate(gpt.blocks):
        mine = MemoryBlock(config, dropout, selective)
        mine.load_state_dict(block.state_dict())
        gpt.blocks[i] = mine
    return gpt


def attention_core(q, k, v, p: float):
    """softmax(q k^T / sqrt(d) + causal mask) -> dropout(p) -> @ v, for q, k, v [B, a, T, d]."""
    T = q.shape[-2]
    mask = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)  # added: nothing saved
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + mask
    return F.dropout(scores.softmax(dim=-1), p) @ v


def causal_attention(q, k, v, p: float, selective: bool = False):
    """The attention core, kept (autograd saves scores' softmax, dropout mask and dropped
    probabilities: 12 a s^2 b bytes in fp32 on CPU) or, with ``selective``, recomputed in backward."""
    if not selective:
        return attention_core(q, k, v, p)
    # BEGIN SOLUTION recompute.selective: the core through Checkpoint (q, k, v kept; softmax, dropout and scores recomputed)
    return Checkpoint.apply(lambda q_, k_, v_: attention_core(q_, k_, v_, p), q, k, v)
    # END SOLUTION


# ----------------------------------------------------------------------------- recomputation

def _cuda_devices(tensors) -> list:
    return sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})


def autocast_state() -> list[tuple[str, dict]]:
    """The autocast state in force now, as ``torch.utils.checkpoint`` captures it: for the CPU
    and, when CUDA is there, for CUDA, ``(device_type, dict(enabled, dtype, cache_enabled))``."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(d, dict(enabled=torch.is_autocast_enabled(d), dtype=torch.get_autocast_dtype(d),
                     cache_enabled=torch.is_autocast_cache_enabled())) for d in devices]


def restore_autocast(state) -> contextlib.ExitStack:
    """A context that puts back an ``autocast_state()`` (each device's autocast entered as it was)."""
    stack = contextlib.ExitStack()
    for device_type, kwargs in state:
        stack.enter_context(torch.autocast(device_type, **kwargs))
    return stack


class Checkpoint(torch.autograd.Function):
    """``Checkpoint.apply(fn, *args)``: ``fn(*args)`` run without recording; only the tensor
    arguments, the other arguments, the RNG state and the autocast state are kept. Backward
    re-runs ``fn`` with the RNG state and the autocast state of the first run, recording, and
    backpropagates through it: the gradients of the tensor arguments that require one are
    returned (None for the others and for non-tensor arguments), those of ``fn``'s parameters
    accumulate into their ``.grad``. The global RNG stream is left where the first run left it
    (the recompute draws on a fork). ``fn`` may return a tensor or a tuple of tensors. As with
    torch's reentrant checkpoint, parameters get gradients only when some argument requires
    one; arguments are positional (wrap keyword arguments in ``fn``)."""

    @staticmethod
    def forward(ctx, fn, *args):
        # BEGIN SOLUTION recompute.checkpoint: keep fn, the tensor args (save_for_backward) and the others, the CPU (and CUDA) RNG state and autocast_state(); run fn under no_grad
        ctx.fn = fn
        ctx.devices = _cuda_devices(args)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.autocast = autocast_state()
        ctx.others = [(isinstance(a, torch.Tensor), None if isinstance(a, torch.Tensor) else a) for a in args]
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        with torch.no_grad():
            return fn(*args)
        # END SOLUTION

    @staticmethod
    def backward(ctx, *grads):
        # BEGIN SOLUTION recompute.checkpoint: under fork_rng restore the saved RNG states, and under restore_autocast(state) with grad enabled re-run fn on detached inputs; torch.autograd.backward(outputs, grads) outside autocast; return None, then one grad per arg
        tensors = iter([t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors])
        args = [next(tensors) if is_tensor else a for is_tensor, a in ctx.others]
        with torch.random.fork_rng(devices=ctx.devices):
            torch.set_rng_state(ctx.cpu_rng)
            for device, state in zip(ctx.devices, ctx.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), restore_autocast(ctx.autocast):
                outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args)
        # END SOLUTION


class Checkpointed(nn.Module):
    """A block whose forward runs through ``Checkpoint``: it keeps only its input."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        if not torch.is_grad_enabled():  # nothing would be saved anyway
            return self.block(x)
        return Checkpoint.apply(self.block, x)


def checkpoint_every(gpt: GPT, k: int) -> list[int]:
    """Wrap blocks 0, k, 2k, ... of ``gpt`` in ``Checkpointed`` (in place; parameter names gain
    ``.block``); returns the indices wrapped. k = 1: every block. Each wrapped block is its own
    checkpoint, so this interpolates between no recomputation and full; Chen et al.'s segments,
    which reach sqrt(L) memory, are ``checkpoint_segments``."""
    if k < 1:
        raise ValueError(f"recompute: checkpoint every k-th block needs k >= 1, got {k}")
    # BEGIN SOLUTION recompute.checkpoint: for i with i % k == 0 replace gpt.blocks[i] by Checkpointed(gpt.blocks[i])
    wrapped = [i for i in range(len(gpt.blocks)) if i % k == 0]
    for i in wrapped:
        gpt.blocks[i] = Checkpointed(gpt.blocks[i])
    return wrapped
    # END SOLUTION


def checkpoint_segments(model: nn.Module, k: int) -> list[list[int]]:
    """Chen et al.'s sqrt(L) scheme (arXiv:1604.06174, section 4): cut ``model.blocks`` (a
    ModuleList run in order, as the course GPT's) into segments of k consecutive blocks (the last
    one shorter when k does not divide L) and run each segment through ``Checkpoint`` as one
    function: forward keeps only each segment's input, ceil(L/k) of them; backward rebuilds one
    segment at a time, k blocks' activations at once. With I the bytes of a block's input and A
    of what one block saves (A includes its input), the peak of saved bytes is

        max(ceil(L/k) I,  max over segments j of  j I + k_j A)  ~  (L/k - 1) I + k A,

    least at k = sqrt(L I / A): k = sqrt(L) where a block saves about its input (Chen's layers),
    smaller (down to k = 1, every block on its own) where a block saves many times its input, as
    a transformer block does. ``model.blocks`` is replaced (in place) by one ``Checkpointed``
    ``nn.Sequential`` per segment (parameter names gain ``.block.<i>``); returns the segments
    as lists of the original block indices."""
    if k < 1:
        raise ValueError(f"recompute: segments of k blocks need k >= 1, got {k}")
    # BEGIN SOLUTION recompute.segments: runs of k consecutive block indices (the last may be shorter); model.blocks = ModuleList of Checkpointed(nn.Sequential(the run's blocks)); return the runs
    blocks = list(model.blocks)
    segments = [list(range(i, min(i + k, len(blocks)))) for i in range(0, len(blocks), k)]
    model.blocks = nn.ModuleList(Checkpointed(nn.Sequential(*(blocks[i] for i in run))) for run in segments)
    return segments
    # END SOLUTION


# ----------------------------------------------------------------------------- measuring saved tensors

class SavedTensors:
    """Counts the bytes autograd saves inside the block (each storage once; parameters, which
    exist anyway, not counted)::

        with SavedTensors(model) as saved:
            loss = model(x).sum()
        saved.bytes
    """

    def __init__(self, *exclude: nn.Module):
        self.skip = {p.untyped_storage()._cdata for m in exclude for p in m.parameters()}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        storage = t.untyped_storage()
        if storage._cdata not in self.skip:
            self.storages[storage._cdata] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def block_saved_bytes(s: int, b: int, h: int, a: int, mode: str = "none", dropout: bool = True,
                      mask_bytes: int = 4) -> int:
    """Bytes one ``MemoryBlock`` saves for backward in fp32 (the chapter derives each term).
    Without dropout: none s b (64 h + 4 a s + 16), selective s b (64 h + 16). Dropout adds a
    mask per residual branch (2 s b h masks) and, unless selective, the attention mask and the
    dropped probabilities (a s^2 b each); a mask element is 4 bytes on CPU (dropout multiplies
    by a float noise tensor), 1 on CUDA (a bool mask): in fp32 on CPU none = s b (72 h + 12 a s
    + 16). full: 4 s b h, the block's input."""
    if mode == "full":
        return 4 * s * b * h
    if mode not in ("none", "selective"):
        raise ValueError(f"recompute: mode is none, selective or full, got {mode!r}")
    per_sbh = 64 + (2 * mask_bytes if dropout else 0)
    per_as = 0 if mode == "selective" else 4 + ((mask_bytes + 4) if dropout else 0)
    return s * b * (per_sbh * h + per_as * a * s + 16)


# ----------------------------------------------------------------------------- offloading

class OffloadPool:
    """Activation offloading with ``saved_tensors_hooks``: inside ``pool.layer(i)`` every tensor
    autograd saves (parameters excepted) is copied to the host (pinned memory when CUDA is
    there) and the device copy dropped; in backward, unpacking a tensor of layer i brings the
    whole layer back and starts bringing layer i - 1 back too (prefetch), so that with an
    asynchronous copy (a side stream, on a GPU) it can run while layer i computes. A layer
    fetched back is released from the host.

    On a CPU-only machine the device and the host are one memory; the pool still keeps the
    books as a GPU would: ``device_bytes`` (saved activations resident on the device) and
    ``host_bytes`` (resident in the host pool), ``peak_device_bytes``, and ``events``, in order:
    ("offload", layer, bytes), ("fetch", layer, bytes), ("prefetch", layer, bytes).

    Every copy goes through ``_to_host`` (forward) and ``_to_device`` (backward); the pool keeps
    no reference to the tensor it was handed (on a GPU, that frees the device memory), and one
    pool serves any number of steps. What is proven where: on CPU (the graded tests) that the
    handed tensors are freed once forward has offloaded them, that each layer is copied back
    once, after backward has entered the layer above it and before it enters the layer itself
    (never two layers ahead), and that the copies are freed once backward is past the layer.
    On CUDA the copies both ways run on a side stream (``copy_streams``), so that forward's
    copies to the host overlap the next layers' forward as backward's copies back overlap the
    layer above (issue 42: they used to run on the current stream, serialised with compute,
    while chapter 12's cost model counts them as hidden); the side stream waits for the current
    one before reading a saved tensor, ``record_stream`` keeps that tensor's memory from being
    reused before the copy has read it, and the copies back wait for an event after the copies
    to the host; each copy back carries an event that the current stream waits for
    only when backward unpacks that tensor, and ``record_stream`` marks its memory in use there:
    so layer i - 1's transfer runs while layer i's backward computes. That CUDA path is checked
    in ``tests/test_gpu.py`` (the same gradients as without offloading, device memory freed after
    forward, the copies on the side stream), which runs only where a GPU is; the overlap itself
    is not measured by the graded tests, which run on CPU.
    """

    def __init__(self, *keep: nn.Module, device: torch.device | str | None = None):
        self.keep = {p.untyped_storage()._cdata for m in keep for p in m.parameters()}
        self.device = torch.device(device) if device is not None else None
        self.pin = torch.cuda.is_available()
        self.host: dict[int, list[torch.Tensor]] = {}       # layer -> its saved tensors on the host
        self.fetched: dict[int, list[torch.Tensor]] = {}    # layer -> back on the device
        self.host_bytes = self.device_bytes = self.peak_device_bytes = 0
        self.events: list[tuple[str, int, int]] = []
        self.copy_streams: dict[int, torch.cuda.Stream] = {}  # CUDA: device index -> the side stream of copies back
        self._offloaded = None                                  # CUDA: event after the last copy to the host

    @contextlib.contextmanager
    def layer(self, index: int):
        """Offload what autograd saves inside this block as layer ``index``."""
        self.host.setdefault(index, [])
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(index, t),
                                                      lambda handle: self._ready(self.unpack(handle))):
            yield

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        stream = self.copy_streams.get(device.index or 0)
        if stream is None:
            stream = self.copy_streams[device.index or 0] = torch.cuda.Stream(device)
        return stream

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        if not t.is_cuda:
            return host.copy_(t)
        # CUDA: on the side stream, so the copy to the host runs while the current stream goes on
        # with the next layer's forward (on the current stream it would wait for it: no overlap).
        # The side stream first waits for the current one (t must be written before it is read);
        # record_stream tells the allocator t's memory is in use on the side stream, so it is not
        # handed out again when autograd drops t, before the copy has read it. The event marks
        # the copies done: the copies back (same stream, so in order anyway) wait for it.
        stream = self._side_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            self._offloaded = torch.cuda.Event()
            self._offloaded.record(stream)
        t.record_stream(stream)
        return host

    def _to_device(self, t: torch.Tensor, device) -> torch.Tensor:
        device = torch.device(device)
        if device.type != "cuda":
            return t.to(device, copy=True)
        # CUDA: on the side stream, so the copy runs while the current stream computes the layer
        # above; it first waits for the copies to the host (the pinned buffer must be written)
        stream = self._side_stream(device)
        if self._offloaded is not None:
            stream.wait_event(self._offloaded)
        with torch.cuda.stream(stream):
            copy = t.to(device, non_blocking=True, copy=True)
            done = torch.cuda.Event()
            done.record(stream)
        copy._labkit_copied = done
        return copy

    @staticmethod
    def _ready(t: torch.Tensor) -> torch.Tensor:
        """CUDA: before backward uses a copy made on the side stream, the current stream waits
        for that copy's event (not for the whole side stream, not the host), and the copy's
        memory is marked in use by the current stream (``record_stream``), so the allocator does
        not hand it out again while backward's kernels may still read it. CPU: nothing to do."""
        done = getattr(t, "_labkit_copied", None)
        if done is not None:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(done)
            t.record_stream(current)
            del t._labkit_copied
        return t

    def pack(self, index: int, t: torch.Tensor):
        """Called when autograd saves ``t`` in layer ``index``: returns what autograd keeps instead."""
        if t.untyped_storage()._cdata in self.keep:
            return ("kept", t)
        # BEGIN SOLUTION recompute.offload: copy t to the host (self._to_host), append it to self.host[index], add its bytes to host_bytes, log ("offload", index, bytes); return (index, position, t.device)
        self.host[index].append(self._to_host(t))
        self.host_bytes += t.nbytes
        self.events.append(("offload", index, t.nbytes))
        return (index, len(self.host[index]) - 1, t.device)
        # END SOLUTION

    def unpack(self, handle):
        """Called when backward needs a saved tensor back."""
        if handle[0] == "kept":
            return handle[1]
        index, position, device = handle
        # BEGIN SOLUTION recompute.offload: fetch layer index if it is not back yet, prefetch index - 1 if it has tensors on the host; return self.fetched[index][position]
        if index not in self.fetched:
            self._bring_back(index, device, "fetch")
        if self.host.get(index - 1):
            self._bring_back(index - 1, device, "prefetch")
        return self.fetched[index][position]
        # END SOLUTION

    def _bring_back(self, index: int, device, why: str) -> None:
        tensors = self.host.pop(index)
        nbytes = sum(t.nbytes for t in tensors)
        self.fetched[index] = [self._to_device(t, device) for t in tensors]
        self.host_bytes -= nbytes
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.events.append((why, index, nbytes))

    def release(self, index: int) -> None:
        """Backward is done with layer ``index``: drop its device copies."""
        tensors = self.fetched.pop(index, [])
        self.device_bytes -= sum(t.nbytes for t in tensors)


def offloaded_forward(gpt: GPT, pool: OffloadPool, idx, targets):
    """``gpt(idx, targets)`` with each block's saved tensors offloaded as its own layer; each
    layer's device copies released once backward has passed the block's input."""
    B, T = idx.shape
    x = gpt.wte(idx) + gpt.wpe(torch.arange(T, device=idx.device))
    for i, block in enumerate(gpt.blocks):
        if x.requires_grad:
            x.register_hook(lambda grad, i=i: (pool.release(i), grad)[1])
        with pool.layer(i):
            x = block(x)
    logits = gpt.lm_head(gpt.ln_f(x))
    return logits, gpt.loss(logits, targets)


# ----------------------------------------------------------------------------- optimizer offload

class OffloadedAdamW:
    """ZeRO-Offload's idea (Ren et al., 2021, arXiv:2101.06840) for one device: the model's
    parameters and gradients stay on the device in 16 bits (2 + 2 bytes per parameter); the
    fp32 master weights and AdamW's two fp32 moments (12 bytes per parameter) live on the host
    (pinned when CUDA is there), and so does the update. Each step sends every gradient down
    (2 bytes per parameter), updates the master on the host, and sends the master, cast to the
    parameter's dtype, back up (2 bytes per parameter). The update is torch.optim.AdamW's
    (decoupled weight decay, bias-corrected moments).

    A parameter without a gradient at a step is skipped (no decay, no moment update) and its
    own step count, which the bias corrections use, does not advance: torch's semantics.
    Parameters that do not require a gradient (frozen) are not taken.

    ``params`` are parameters or, as for torch's optimizers, param groups: dicts with "params"
    and any of ``lr``, ``betas``, ``eps``, ``weight_decay`` overriding the defaults for that group
    (e.g. no weight decay on biases and norms). Parameters may differ in dtype.

    ``master``, ``exp_avg``, ``exp_avg_sq``: the host tensors, one per parameter, in order;
    ``param_groups``: the groups with their options; ``options[i]``: parameter i's
    (lr, betas, eps, weight_decay); ``param_steps``: each one's step count; ``moved_bytes``:
    bytes sent over the link so far, both ways. ``step`` writes the parameters (in place) and
    sets no ``.grad``."""

    OPTIONS = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = []
        for group in groups:
            unknown = set(group) - {"params", *self.OPTIONS}
            if unknown:
                raise ValueError(f"recompute: OffloadedAdamW param group with unknown options {sorted(unknown)}")
            tensors = group["params"]
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            options = {name: group.get(name, defaults[name]) for name in self.OPTIONS}
            self.param_groups.append({"params": [p for p in tensors if p.requires_grad], **options})
        self.params = [p for group in self.param_groups for p in group["params"]]
        if not self.params:
            raise ValueError("recompute: OffloadedAdamW got no parameter that requires a gradient")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("recompute: OffloadedAdamW got a parameter twice (in two groups, or twice in one)")
        self.options = [tuple(group[name] for name in self.OPTIONS) for group in self.param_groups for _ in group["params"]]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay  # the defaults
        self.steps, self.moved_bytes = 0, 0
        self.param_steps = [0] * len(self.params)  # per parameter, as torch's: steps it had a gradient
        pin = torch.cuda.is_available()
        # BEGIN SOLUTION recompute.optimizer_offload: master = each parameter as fp32 on the host (pinned if CUDA); exp_avg and exp_avg_sq fp32 zeros like it
        self.master = [torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin).copy_(p.detach())
                       for p in self.params]
        self.exp_avg = [torch.zeros_like(w) for w in self.master]
        self.exp_avg_sq = [torch.zeros_like(w) for w in self.master]
        # END SOLUTION

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for i, (p, w, m, v) in enumerate(zip(self.params, self.master, self.exp_avg, self.exp_avg_sq)):
            if p.grad is None:  # no gradient this step: untouched, and its step count stays (as torch's)
                continue
            lr, (beta1, beta2), eps, weight_decay = self.options[i]  # its group's
            # BEGIN SOLUTION recompute.optimizer_offload: this parameter's step count + 1 (bias corrections from it); grad to the host as fp32; w *= 1 - lr wd; m, v updated; w -= lr/c1 * m / (sqrt(v)/sqrt(c2) + eps); p.copy_(w) back; count the bytes both ways
            self.param_steps[i] += 1
            correction1, correction2 = 1 - beta1 ** self.param_steps[i], 1 - beta2 ** self.param_steps[i]
            grad = p.grad.to("cpu", torch.float32)
            self.moved_bytes += p.grad.nbytes
            w.mul_(1 - lr * weight_decay)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denominator = (v.sqrt() / math.sqrt(correction2)).add_(eps)
            w.addcdiv_(m, denominator, value=-lr / correction1)
            p.copy_(w.to(p.dtype).to(p.device))                  # cast on the host: 2 bytes go up, not 4
            self.moved_bytes += p.nbytes
            # END SOLUTION


# ----------------------------------------------------------------------------- accumulation

def accumulate(model: nn.Module, micro_batches, loss_fn, group=None, ignore_index: int = -100) -> torch.Tensor:
    """Forward and backward of every micro-batch in ``micro_batches`` (a list of (x, y)), one at
    a time. ``loss_fn(model, x, y)`` is the mean loss over the micro-batch's *counted* targets,
    those of ``y`` that are not ``ignore_index`` (``F.cross_entropy``'s mean: padding is not in
    it). A micro-batch holds c_i = ``(y != ignore_index).sum()`` of them, not ``y.numel()``;
    micro-batches may differ in length and in padding, so each loss is weighted by its share
    c_i / C of this rank's C counted targets (with equal, unpadded sizes, 1/m). The gradient
    left is that of the mean over every counted target of this rank's micro-batches, as one
    batch of them all would give. A micro-batch with no counted target is skipped (its mean is
    0/0; it weighs 0); a rank with none at all raises ValueError before anything runs.
    Then, when ``group`` (default: every rank) has N > 1 ranks, one all-reduce per parameter
    gradient over ``group`` (SUM, then / N: gloo has no AVG): the ranks' gradients averaged,
    each rank weighing the same (as DDP does, whatever its token count). Parameters without a
    gradient (frozen, or unused in the forward) are left alone. Returns this rank's
    token-weighted mean loss (detached). Writes the parameters' ``.grad`` (accumulates)."""
    m = len(micro_batches)
    if m < 1:
        raise ValueError("recompute: accumulate needs at least one micro-batch")
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    counted = [int((y != ignore_index).sum()) for _, y in micro_batches]
    tokens = sum(counted)
    if tokens == 0:
        raise ValueError(f"recompute: accumulate got no target that is not ignore_index={ignore_index}")
    total = torch.zeros(())
    # BEGIN SOLUTION recompute.accumulate: backward of loss x (its counted targets / all counted targets) per micro-batch with any (nothing communicated); after the last, all_reduce each parameter's grad over group and divide by N
    for (x, y), count in zip(micro_batches, counted):
        if count == 0:
            continue
        loss = loss_fn(model, x, y) * (count / tokens)
        loss.backward()
        total = total + loss.detach()
    if n > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(n)
    # END SOLUTION
    return total


# ----------------------------------------------------------------------------- chunked cross-entropy

class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of ``hidden @ weight^T (+ bias)`` against ``targets``, one chunk of
    ``chunk_size`` rows at a time: forward keeps only each row's log-sum-exp (N floats); backward
    recomputes each chunk's logits, turns them into that chunk's gradient
    ``(softmax - onehot) * grad / count`` and drops them before the next chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index):
        n = hidden.shape[0]
        keep = targets != ignore_index
        count = keep.sum()
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight.float()
        b = None if bias is None else bias.float()
        # BEGIN SOLUTION recompute.chunked_ce: per chunk of rows: logits = h.float() @ w.T (+ b); lse = torch.logsumexp (max subtracted); total += (lse - logits[row, target]) over kept rows; save hidden, weight, bias, targets, lse; return total / count
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = hidden[rows].float() @ w.T
            if b is not None:
                logits = logits + b
            lse[rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, torch.where(keep[rows], targets[rows], 0).unsqueeze(1)).squeeze(1)
            total = total + torch.where(keep[rows], lse[rows] - picked, 0.0).sum()
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total / count
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk_size, ignore_index = ctx.chunk_size, ctx.ignore_index
        keep = targets != ignore_index
        w = weight.float()
        b = None if bias is None else bias.float()
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.zeros_like(w)
        grad_b = None if bias is None else torch.zeros_like(b)
        # BEGIN SOLUTION recompute.chunked_ce: scale = grad / count; per chunk recompute the logits, g = (exp(logits - lse) - onehot) * scale, zero on ignored rows (torch.where: all ignored gives zero gradients, as torch); grad_h[rows] = g @ w, grad_w += g.T @ h, grad_b += g.sum(0)
        scale = grad / keep.sum()
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].float()
            logits = h @ w.T
            if b is not None:
                logits = logits + b
            g = torch.exp(logits - lse[rows].unsqueeze(1))
            del logits
            g.scatter_add_(1, torch.where(keep[rows], targets[rows], 0).unsqueeze(1), -torch.ones_like(g[:, :1]))
            g = g * torch.where(keep[rows], scale, 0.0).unsqueeze(1)
            grad_h[rows] = g @ w
            grad_w += g.T @ h
            if grad_b is not None:
                grad_b += g.sum(0)
            del g
        # END SOLUTION
        return (grad_h.to(hidden.dtype), grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                          bias: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, targets, ignore_index=ignore_index)`` (the mean
    over the tokens whose target is not ``ignore_index``) without the [N, V] logits: ``hidden``
    is [N, h] (N tokens; flatten [s, b, h] first), ``weight`` [V, h], ``bias`` [V] or None,
    ``targets`` [N] integers. The logits of ``chunk_size`` rows at a time exist, in forward and
    again (recomputed) in backward: chunk_size x V x 4 bytes instead of N x V x 4.

    Logits, softmax and the sums are computed in fp32 whatever the inputs' dtype (bf16 and fp16
    included); the loss returned is an fp32 scalar, the gradients come back in each input's
    dtype. The log-sum-exp subtracts the row's max, so logits of 1e4 do not overflow. When every
    target is ignored the loss is nan (0 / 0) and the gradients are zero, as torch's."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"recompute: chunk_size must be an integer >= 1, got {chunk_size!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"recompute: hidden [N, h] and weight [V, h] needed, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"recompute: targets must be [N] = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"recompute: bias must be [V] = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    return ChunkedCrossEntropy.apply(hidden, weight, bias, targets, chunk_size, ignore_index)
