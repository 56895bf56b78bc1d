"""Chapter 11 exercises: communication efficiency. Send less (compression), route by topology, hide it.

Every chapter so far averaged gradients with one flat all-reduce of full-precision values.
Two levers cut its cost:

* Send fewer bytes. DDP lets you replace the all-reduce of each gradient bucket by a
  *communication hook*, ``hook(state, bucket) -> torch.futures.Future[Tensor]``: the hook gets
  the bucket's flat gradient (``bucket.buffer()``, the per-parameter views in
  ``bucket.gradients()``), must leave the average of every rank's bucket in it, and returns a
  future whose value is that buffer. It returns while its collectives are still in flight (not
  a completed future: DDP's backward goes on with the next buckets meanwhile); a step that
  needs a collective's result is chained on its future (``.then``, ``after``).
  ``ddp.register_comm_hook(state, hook)`` installs one on
  ``torch.nn.parallel.DistributedDataParallel``; ``FlatBucket`` lets you call a hook by hand on
  a list of tensors (``labkit.hooks`` holds it and the futures' plumbing, given; importable
  from here and from each hook's file too).

  - fp16/bf16: cast the bucket to 16 bits, divide by N *before* summing (an fp16 sum of N
    large gradients overflows at 65504), all-reduce, cast back. Half the bytes; each value
    carries a relative error of about 2^-11 (fp16) or 2^-8 (bf16). Dividing first trades
    overflow for underflow (quotients below 6.1e-5 lose bits, below 6e-8 vanish): fp16
    training scales the loss (``torch.amp.GradScaler``); bf16 has fp32's range.
  - PowerSGD (Vogels, Karimireddy and Jaggi, 2019, arXiv:1905.13727): view each gradient
    as an n x m matrix M and send a rank-r approximation, r(n + m) numbers instead of nm,
    found by one step of power iteration per training step:
        P = M Q;  all-reduce P;  orthogonalise P;  Q = M^T P;  all-reduce Q, / N;  M ~ P Q^T
    All-reducing P and Q (not M) is what makes the method linear across ranks: the summed
    P is the P of the summed M (for the shared Q). Three details make it work in practice:
      * warm start: this step's Q starts from last step's (orthogonalised), so the power
        iteration continues across steps instead of starting from noise each time;
      * error feedback: what the approximation left out of this rank's gradient, M - P Q^T,
        is added to the next step's gradient, so no part of the gradient is lost, only
        delayed; the sum of the applied gradients differs from the sum of the true ones by
        the last error alone;
      * tensors not worth compressing (biases and other 1-D tensors, any matrix where
        r(n + m) x min_compression_rate >= nm) go through one plain all-reduce.
    ``PowerSGDState`` (given) holds the same state as torch's ``PowerSGDState`` (per bucket:
    the error, P and Q), so the two hooks can be compared step by step. Like torch, lay P
    and Q out (and draw the first random Qs) grouped by matrix shape: on a transformer the
    shapes repeat layer after layer, and bucket order would give each Q other numbers.
  - top-k (Aji and Heafield 2017, arXiv:1704.05021; Lin et al. 2018, arXiv:1712.01887):
    each rank sends only the k = ratio x numel entries of largest magnitude, as (index,
    value) pairs, and keeps the rest as its error for the next step (error feedback,
    Karimireddy et al. 2019, arXiv:1901.09847). Two ranks' top-k sets differ, so the sparse
    sum cannot be built by a ring that adds chunks on the way: every rank all-gathers
    everyone's pairs (N k of them) and adds them up itself.

* Route by topology. Inside a node GPUs talk over NVLink (hundreds of GB/s); across nodes
  over InfiniBand or Ethernet (tens of GB/s per GPU). Both a flat ring and the hierarchical
  scheme send about 2S out of each node; what differs is how many NICs carry it and how many
  latency terms it pays (one ring uses one NIC per node; NCCL's rail-aligned rings use them
  all; chapter 11 section 1 compares the three). Hierarchical all-reduce on
  ``nodes x ranks_per_node`` ranks: reduce-scatter inside the node (each rank holds the
  node's sum of 1/L of the buffer), all-reduce of that shard across nodes (one ring per local
  index, all L at once: each rank sends 1/L of the bytes over its own NIC), all-gather inside
  the node: 2(L - 1) + 2(M - 1) steps instead of the flat ring's 2(N - 1).

* Hide what remains (the last section, "collective matmul"). Sequence parallelism's all-gather
  before a column-parallel matmul, and its reduce-scatter after a row-parallel one, are split
  into their N - 1 ring steps so that each chunk's matmul runs while the next chunk travels
  (Wang et al. 2022, ASPLOS '23; torchtitan's async tensor parallelism).

Tasks (run ``labkit grade compress``; tests in ``tests/grading/test_compress.py``):
    compress.fp16          compress_hook (fp16_compress_hook and bf16_compress_hook call it)
    compress.powersgd      should_compress, orthogonalize, powersgd_compress (powersgd_hook runs it)
    compress.topk          topk_hook
    compress.hierarchical  hierarchical_all_reduce
    compress.ag_matmul     ring_all_gather_matmul, AllGatherMatmul
    compress.matmul_rs     ring_matmul_reduce_scatter, MatmulReduceScatter
    compress.local_sgd     LocalSGD.step (local SGD / DiLoCo: H local steps, then an outer step on the averaged delta)
``NodeGroups`` (given) checks ``nodes x ranks_per_node`` against the world (ValueError before
any communication) and makes the groups; ``hierarchical_hook`` runs your all-reduce as a hook.

The hooks run on torch's ``DistributedDataParallel`` and on the chapter-02 ``labkit.ddp.DDP``
(both: ``model.register_comm_hook(state, hook)``), or by hand on a ``FlatBucket``.

One file per technique; import everything from ``labkit.compress`` as the chapter does:
    fp16.py               compress.fp16
    powersgd.py           compress.powersgd
    topk.py               compress.topk
    hierarchical.py       compress.hierarchical
    collective_matmul.py  compress.ag_matmul, compress.matmul_rs (with the given layers and MLP)
    local_sgd.py          compress.local_sgd
"""

from labkit.hooks import FlatBucket, after, average_future, completed, future_of, in_turn  # noqa: F401 - the hooks' plumbing (given)
from labkit.compress.fp16 import bf16_compress_hook, compress_hook, fp16_compress_hook  # noqa: F401
from labkit.compress.powersgd import (  # noqa: F401
    PowerSGDState, orthogonalize, powersgd_compress, powersgd_elements, powersgd_hook, should_compress)
from labkit.compress.topk import TopKState, topk_count, topk_hook  # noqa: F401
from labkit.compress.hierarchical import (  # noqa: F401
    NodeGroups, hierarchical_all_reduce, hierarchical_bytes, hierarchical_hook)
from labkit.compress.collective_matmul import (  # noqa: F401
    AllGatherColumnLinear, AllGatherMatmul, CollectiveMatmulMLP, MatmulReduceScatter, MatmulReduceScatterLinear,
    ring_all_gather_matmul, ring_matmul_reduce_scatter, ring_peers, start_exchange)
from labkit.compress.local_sgd import DILOCO_OUTER, LocalSGD  # noqa: F401
