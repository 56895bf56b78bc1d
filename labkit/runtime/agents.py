"""Ranks the rank server did not start, and the agents beside a process group.

``labkit.runtime.launcher`` starts its own ranks; this module holds what a rank needs besides:

* under torchrun, ``launch`` runs ``fn`` in the process torchrun started
  (``run_under_torchrun``): it builds the process group from torchrun's store, under a key space
  of the rendezvous round's own (``_agree_on_round``), and shares the results with every rank;
* an RPC agent beside the process group (``launch(..., rpc=True)``, in either kind of launch):
  ``start_rpc`` rendezvouses through the group's store, ``stop_rpc`` shuts it down;
* ``release_process_groups``: a group torn down so that it cannot abort the process at exit.
"""

from __future__ import annotations

import atexit
import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist



# ----------------------------------------------------------------------------- torchrun


RPC_STORE_PREFIX = "labkit/rpc/"  # the RPC agents' rendezvous keys, beside the process group's


def rpc_name(rank: int) -> str:
    """The RPC name of ``rank`` in a ``launch(..., rpc=True)`` job (and under torchrun)."""
    return f"worker{rank}"


def run_under_torchrun(fn, world_size, args, kwargs, backend, rpc=False, rpc_timeout=None) -> list:
    """torchrun already started the ranks: run here, then share the results with every rank.
    ``backend``: the one ``launch`` resolved for this node's GPUs."""
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(fn, {world_size}) under torchrun with WORLD_SIZE={env_world}: "
                         f"start torchrun with --nproc-per-node {world_size} (or pass world_size from the env)")
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, store=_torchrun_store(), rank=int(os.environ["RANK"]),
                                world_size=env_world)
        # Ours to clean up. Left to interpreter shutdown, gloo's worker threads may still be
        # releasing the last op's tensors, which needs the GIL: the process aborts (SIGABRT).
        atexit.register(_destroy_process_group)
    from torch.distributed.rpc.api import _is_current_rpc_agent_set
    own_agent = rpc and not _is_current_rpc_agent_set()  # ours to start and to shut down
    if own_agent:
        start_rpc(int(os.environ["RANK"]), env_world, rpc_timeout or 180.0)
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        if own_agent:  # a local shutdown: a graceful one would wait for peers that wait for us
            stop_rpc(graceful=False)
        raise
    results = [None] * world_size
    dist.all_gather_object(results, result)
    if own_agent:
        stop_rpc(graceful=True)
    return results


# ----------------------------------------------------------------------------- RPC agents


_RPC_SCHEME = "labkit-rpc"


def start_rpc(rank: int, world_size: int, rpc_timeout: float) -> None:
    """``rpc.init_rpc`` as ``rpc_name(rank)``, rendezvousing through the process group's store.

    ``init_rpc`` finds its store by URL; our handler answers with the default group's store
    under ``RPC_STORE_PREFIX``, so the agents need no port of their own."""
    import warnings
    from torch.distributed import rpc

    def handler(url, rank=-1, world_size=-1, **kwargs):
        yield dist.PrefixStore(RPC_STORE_PREFIX, dist.distributed_c10d._get_default_store()), rank, world_size

    dist.register_rendezvous_handler(_RPC_SCHEME, handler)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"{_RPC_SCHEME}://", rpc_timeout=rpc_timeout)
    with warnings.catch_warnings():  # the TensorPipe agent's own use of a deprecated gloo API
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
        rpc.init_rpc(rpc_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)


def stop_rpc(graceful: bool = True, timeout: float = 0) -> None:
    """``rpc.shutdown``: graceful is a barrier of every agent, local ends only this one."""
    from torch.distributed import rpc
    from torch.distributed.rpc.api import _is_current_rpc_agent_set
    if _is_current_rpc_agent_set():
        rpc.shutdown(graceful=graceful, **({"timeout": timeout} if timeout else {}))


def _torchrun_store():
    """torchrun's store, with a key space of this rendezvous round's own.

    torchrun's agents keep one store server across restarts and membership changes, so it
    still holds a dead round's keys (its ranks' addresses): a new group that read them would
    wait forever in ``init_process_group``. The ranks of a round first agree on a fresh name
    (``_agree_on_round``) and build their group under it. (The restart count is no such name:
    each agent counts its own restarts, and a node that rejoins starts again at 0.)"""
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"  # the agent serves it
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timedelta(seconds=900))
    return dist.PrefixStore(f"labkit/round-{_agree_on_round(store, rank, world)}/", store)


ROUND_KEYS = "labkit/round"


def _agree_on_round(store, rank: int, world: int, timeout: float = 900.0) -> str:
    """A name every rank of this round agrees on, that no earlier round used.

    Every rank draws a random token. Rank r > 0 keeps writing its token under its rank until
    an answer appears under *its token* (so no stale answer can be read). Rank 0 first deletes
    the tokens under every rank (a dead round's; the live ranks write theirs again), then
    waits for one from each rank and answers each with its own token, the round's name.
    Old rounds' processes are all gone when a new round starts (torchrun stops every worker
    before it rendezvouses again), so whatever rank 0 reads after its deletion is fresh."""
    token = uuid.uuid4().hex
    deadline = time.monotonic() + timeout
    if rank == 0:
        for r in range(1, world):
            store.delete_key(f"{ROUND_KEYS}/hello/{r}")
        tokens = []
        for r in range(1, world):
            key = f"{ROUND_KEYS}/hello/{r}"
            while not store.check([key]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} never joined this torchrun round")
                time.sleep(0.02)
            tokens.append(store.get(key).decode())
        for other in tokens:
            store.set(f"{ROUND_KEYS}/answer/{other}", token)
        return token
    answer = f"{ROUND_KEYS}/answer/{token}"
    while True:
        store.set(f"{ROUND_KEYS}/hello/{rank}", token)
        if store.check([answer]):
            return store.get(answer).decode()
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never answered in this torchrun round")
        time.sleep(0.02)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        release_process_groups()


def release_process_groups() -> None:
    """``dist.destroy_process_group()``, and make sure the groups are really gone.

    A gloo group that something still references outlives ``destroy_process_group`` into
    interpreter shutdown, where its worker threads can abort the process (SIGABRT,
    "terminate called without an active exception"). DTensor caches sharding decisions and,
    with them, every ``DeviceMesh`` it saw, and a mesh holds its groups: drop those references
    first. Safe to call when no group exists."""
    import gc
    from torch.distributed.device_mesh import DeviceMesh
    gc.collect()
    for obj in gc.get_objects():
        if DeviceMesh in type(obj).__mro__:  # not isinstance: it would probe every object's class
            getattr(obj, "_pg_registry", {}).clear()
    if dist.is_initialized():
        dist.destroy_process_group()
