"""Graded tests for chapter 10: expert parallelism (a mixture-of-experts layer routed by all-to-all).

Every task is graded on the whole API it exposes, not only its defaults; each check runs on
every rank and compares with a single-process reference. Configurations are looped inside
one launch per world size (1 is a diagnostic; 2, 3 and 4 carry the points).

moe.router: top-k at k = 1, 2, 3 and E (E = 5 experts, T = 13 tokens: neither divides the
other) in float64, float32, bfloat16 and float16, even and uneven routing (every token on
one expert: the others get no choice at all, so ``bincount`` needs its ``minlength``),
against a float64 reference of the same inputs: logits, softmax, the experts (the k most
probable, most probable first), the weights (renormalised over the k chosen for k >= 2, the
chosen probability itself for k = 1, as in Switch: a renormalised top-1 weight is 1 and
trains no router), the auxiliary loss E sum_e f_e P_e with f normalised by the T k choices,
the z-loss, every output's dtype, and the gate's gradient from the task loss (non-zero at
k = 1), from the auxiliary loss (f carries none) and from the z-loss. The z-loss and the
softmax are also checked on logits large enough that exp overflows (1e3 in float64 and
float32, 1e3 in bfloat16, 30 in float16).

moe.router, drawn (``tests/grading/configs.py``: a new seed each run, ``LABKIT_SEED`` replays it,
``LABKIT_LONG=1`` draws 200 instead of 24 per launch): T 1-17, E 1-8, k 1-E, H 1-7, the four dtypes,
x row- or column-major, ordinary or saturating logits (probabilities underflowing to 0), exact
ties (a duplicated gate row; tokens of zeros); the experts a top-k of the exact probabilities in
order (any order among ties), and the gradients of the gate and of the tokens for random incoming
gradients on weights, probs, logits, aux and z-loss at once. (``route`` documents x as [T, H]:
3-D tokens are the layer's, flattened before routing, so none is drawn here.)

moe.capacity: ``expert_capacity`` against exact fractions at k = 1, 2, 3 and E, with factors
that drop and factors that do not, C k T / E an exact integer (no rounding up) and not;
``keep_mask`` against a loop over choices for k = 1, 2, 3 and E, T = 7, 11, 13 tokens, some
experts chosen by nobody, at capacities derived from factors 0.5, 1, 2 and None, and exactly
at the boundary (the fullest expert's count: nothing dropped; one less: one choice dropped).

moe.capacity, drawn: 400 (T <= 4096, E <= 64, k, C) per launch, C dyadic, tiny (1e-6 ...), two
decimals or up to 16, more than half with C k T / E an exact integer (no rounding up; catches a
reordered float formula), against ceil of the exact fraction; 24 keep_mask tables (E 1-8, k 1-E,
T 1-40, skewed or not, row- or column-major) at capacities 1, drawn, from a factor, the fullest
count, one less and None, against the loop.

moe.dispatch: ``AllToAll`` and ``exchange_counts`` on the world and on subgroups (N = 3: the
pair {0, 1} with rank 2 a bystander; N = 4: the pairs {0, 1}, {2, 3} and the 2x2 grid's
other axis {0, 2}, {1, 3}), in float64, float32, bfloat16 and float16, with uneven splits (a
rank that sends nothing, a rank that receives nothing), a non-contiguous input, the
backward, and exchange_counts with 1, 2 and 3 experts per rank (2: counts a strided view);
values are exact (data movement); the trace is exactly one all-to-all forward and one
backward in that group, of max(rows sent, received) x H x element size bytes.

moe.dispatch, drawn: 8 cases per launch on a drawn group, dtype and H: two ``AllToAll`` calls
with their own uneven splits (zeros included; half the time the same receive totals), both
forward before one backward, random rows and random incoming gradients, row- or column-major;
exact values both ways, the first output untouched by the second call, the trace; then
``exchange_counts`` of drawn counts (E/N 1-3, up to 1e12, zeros, strided or not). (``AllToAll``
documents rows [M, H]: no 3-D rows are drawn.)

moe.layer: ``ExpertParallelMoE`` on the world and the same subgroups at k = 1, 2, 3 and E,
dropless, dropping, exactly at capacity, uneven routing (experts with no token, ranks that
receive no row), each rank with its own token count (5 + 2 x its group rank: divides
neither E nor N), in float64, float32, bfloat16 and float16, against ``reference_moe`` (one
process, every expert, the group's tokens) in the same dtype: output, aux, z-loss, routed
rows and their dtypes, the input's, the gate's (summed over the group) and this rank's
experts' gradients; at k = 1 the gate's gradient from the task loss alone is non-zero and
the reference's. The trace of a forward and backward is, in order: the E int64 counts, the
dispatch and the combine, then both again in backward, every one in the group, the rows'
bytes max(sent, received) x H x element size from the reference routing. Three steps of
AdamW, and of momentum SGD with a frozen gate, against the reference's. Bad input raises
ValueError before any communication.

moe.layer, drawn (``test_layer_drawn``): 6 configurations per world size (2, 3) drawn from the
whole documented space with a new seed each run (printed as LABKIT_SEED; ``LABKIT_LONG=1``: 40):
E/N from 1 to 3, k from 1 to E, dropless or any capacity factor, the four dtypes, H and F from
1 to 9, [B, T, H] inputs of each rank's own shape, even or skewed routing; a random incoming
gradient for y and random weights on aux and z-loss; then a second call with other shapes.

moe.ep_dp: a 2-layer MoE GPT (labkit.models) trained 3 steps with the learner's EP layer on
every grid of the world (4 = 2x2, 4x1, 1x4; 3 = 3x1, 1x3; 2 = 2x1, 1x2) in three cases, all
three on the first grid of each world size and one each, in turn, on the others: k = 2
dropless with AdamW; k = 1, capacity 1.0, uneven routing (most tokens on expert 0) with
momentum SGD, a frozen parameter and an unused one (no gradient: no all-reduce); k = 3,
capacity 1.0 with AdamW. Against
one process holding every expert that runs the same global batch in the same slices: the
global loss of every step, every dense parameter and this rank's experts after each step.
Drawn (a new seed each run): one more case per launch on any grid of the world, E/ep 1-3, k
1 to min(E, 3), dropless or a capacity factor in [0.5, 2], even or skewed routing, either
optimizer, frozen and unused parameters or not, other weights and data, a scaled loss.
The trace of step 1 is, in order: per MoE layer the counts and two all-to-alls in the EP
group forward, two per layer backward (last layer first), then one all-reduce per parameter
with a gradient, in ``model.parameters()`` order, dense over the world and expert over the
DP group.

moe.bias_balance: auxiliary-loss-free balancing (DeepSeek-V3, arXiv:2412.19437, 2.1.2).
``route(x, gate, k, bias=b)`` at k = 1, 2, 3 in float64, float32, bfloat16 and float16 with a
bias that changes some tokens' choice (checked): the experts are the top-k of probs + b in
float32, highest biased score first; the weights the *unbiased* probabilities of those
experts (renormalised for k >= 2, not for k = 1) against a float64 reference; logits and
probs; dtypes; the gate's gradient of a task loss is the reference's (the bias never enters
a weight) and the bias gets none. ``BiasBalancer.count`` then ``update()`` with gamma = 0.01
(not the default) over 4 steps of counts built so that the group's load has ties with its
mean (sign 0), differences larger than 1 (sign, not difference) and a rank's own counts of
another sign pattern than the group's, against a loop in the test: counts added over two
routings ([T, 2] and [T, 1]) with nothing communicated, then the bias after each update,
float32, the same tensor returned, the counts zeroed, bitwise identical on every rank of the
group, one all-reduce of E int64 in the group per update; on the world and the subgroups
(N = 3: {0, 1} with rank 2 a bystander; N = 4: pairs {0, 1}, {2, 3} and {0, 2}, {1, 3}).
``BiasBalancer.route`` in a training loop (issue 42: the bias used to move at every call) on a
skewed gate over 4 steps at k = 1, 2, 3 in float64, each rank its own tokens: per step three
micro-batches of 13, 7 and 10 tokens, the first through a reentrant checkpoint (as
``torch.utils.checkpoint(use_reentrant=True)``: its routing runs again in backward), each loss scaled before backward, and an evaluation
routing under no_grad; every routing of the step (recompute and evaluation included) chooses
with the bias of steps 1 ... s-1, the gate's gradient summed over the micro-batches is the
reference's, ``counts`` hold each micro-batch once, nothing is communicated before
``update()``, which is one all-reduce and moves the bias by the group's load of the whole step.
Drawn (a new seed each run, the same stream on every rank): E 2-12, gamma 1e-4 to 0.5, 2-4
steps of drawn counts per rank (zeros, idle experts) counted as [T, k] routings of drawn k, an
empty one included, in every group of the world's layouts, against the same loop.

moe.shared_overlap: shared experts (DeepSeekMoE) computed while the all-to-alls are in flight.
``AllToAllOverlap`` on its own, on the world and the subgroups, in the four dtypes, with uneven
splits (a rank that sends or receives nothing): the rows exact, a non-contiguous input and a
non-contiguous incoming gradient, a side side(u, v, u) = u @ v + u (u passed twice: each use
gets its own gradient; v frozen: no gradient), the trace one all-to-all each way in the group.
``SharedExpertMoE`` with 1 and 2 shared experts of width F_s = 10 (a width no other tensor has)
at k = 1, 2, 3, dropless, dropping and uneven, in float64 and float32 on every group (N = 3: the
pair {0, 1}, rank 2 a bystander; N = 4: the pairs) and bfloat16 and float16 on the world, against
one process (``reference_moe`` plus each shared expert's MLP, one by one): output, aux, z-loss,
input gradient, this rank's routed experts' gradients, the gate's and the shared experts'
gradients summed over the group; the trace exactly ``moe.layer``'s (counts, dispatch, combine,
both reversed in backward; the shared experts send nothing). Overlap, from the timeline (event
order, not time; a matmul is the shared experts' when one of its tensors has dimension F_s or
S F_s and none the routed width F): each of the four row all-to-alls has shared-expert matmuls
between its post and its wait, and no shared-expert matmul runs while none is in flight (so
waiting at once, computing the shared experts before posting, recomputing them outside, or a
plain combine all fail). Three steps of AdamW (2 shared experts of the default width) and of
momentum SGD with the gate and the shared experts frozen, on the world and the last subgroup,
against the reference's. Bad input (no shared expert, width 0) raises ValueError before any
communication.

moe.shared_overlap, drawn: 3 ``SharedExpertMoE`` cases per launch on a drawn group: E/N 1-3, k 1-E,
dropless or a drawn factor, the four dtypes, H and F 1-9, 1-3 shared experts of width 1-9 or the
routed width, [B, T, H] inputs of each rank's own shape (B up to 3), a random incoming gradient
and random weights on aux and z-loss, called twice with other shapes, against ``shared_reference``.

Tolerances: labkit.check's per dtype; where a value is a sum reordered between the parallel
code and the reference (matmuls over other batches, gradients summed over ranks), the
absolute tolerance is raised to rtol x the largest |expected| of the tensor (``near``).
"""

import copy
import math
import random
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from labkit.check import assert_close, tolerance
from labkit.comm import CommTracer, ConfinedTracer, Op, Step, assert_ops, assert_overlap
from labkit.course.grading import run_graded, task
from tests.grading import configs

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def near(actual, expected, what: str, terms: torch.Tensor | None = None) -> None:
    """assert_close with labkit.check's tolerance for ``expected``'s dtype, atol raised to
    rtol x max|expected| (a reordered sum of terms of that size differs by that much), or to
    rtol x max ``terms`` where ``expected`` sums parts that may cancel (``terms``: their largest
    magnitudes, from ``reference_over_ranks``)."""
    rtol, atol = tolerance(expected.dtype)
    if expected.is_floating_point() and expected.numel():
        scale = expected.detach().abs().max().double().item()
        if terms is not None and terms.numel():
            scale = max(scale, terms.max().item())
        atol = max(atol, rtol * scale)
    assert_close(actual, expected, what, rtol=rtol, atol=atol)


def reference_over_ranks(reference, xs: list, params: list, loss, me: int):
    """One process standing in for a group: ``reference(x, *params)`` on each group rank's
    input, and the gradients of sum_r ``loss(r, *outputs of r)``, taken per rank and summed in
    float64 as the group sums its ranks' parts. Sets each ``x.grad``. Returns (rank ``me``'s
    outputs, each parameter's summed gradient in its dtype, each one's ``terms`` for ``near``:
    the largest |part| elementwise). In bfloat16 two ranks' parts can cancel to an exact 0 that
    the layer, summing once in float32, misses by a rounding of the parts (CI, seed 2075568586)."""
    mine, parts = None, []
    for r, x in enumerate(xs):
        outputs = reference(x, *params)
        grads = torch.autograd.grad(loss(r, *outputs), [x, *params], allow_unused=True)
        x.grad = grads[0]
        parts.append([torch.zeros_like(p, dtype=torch.float64) if g is None else g.double()
                      for p, g in zip(params, grads[1:])])
        if r == me:
            mine = outputs
    sums = [sum(each).to(p.dtype) for p, each in zip(params, zip(*parts))]
    terms = [torch.stack(each).abs().amax(0) for each in zip(*parts)]
    return mine, sums, terms


def assert_sequence(tracer: CommTracer, want: list, what: str) -> None:
    """The whole trace, in order, is ``want``."""
    got = tracer.ops()
    assert_ops(tracer, want, what)  # says what is extra or missing
    if list(got) != list(want):
        lines = "\n".join(f"  #{i}: got {g!r}, want {w!r}" for i, (g, w) in enumerate(zip(got, want)) if g != w)
        raise AssertionError(f"{what}: the ops are the technique's but in the wrong order\n{lines}")


def groups_of_world() -> list:
    """(name, members, group handle) for the world and its subgroups; every rank creates every
    group (new_group is collective) but runs only those it belongs to. N = 3: the pair {0, 1}
    with rank 2 a bystander; N = 4: the pairs {0, 1}, {2, 3} and the 2x2 grid's other axis."""
    n = dist.get_world_size()
    out = [("world", list(range(n)), None)]
    if n == 3:
        out.append(("pair {0,1} (rank 2 a bystander)", [0, 1], dist.new_group([0, 1])))
    if n == 4:
        for name, split in (("pairs {0,1},{2,3}", ([0, 1], [2, 3])), ("grid axis {0,2},{1,3}", ([0, 2], [1, 3]))):
            handles = [dist.new_group(members) for members in split]
            for members, handle in zip(split, handles):
                out.append((f"{name}: group {members}", members, handle))
    return out


# ----------------------------------------------------------------------------- router

R_EXPERTS, R_TOKENS, R_HIDDEN = 5, 13, 6
LARGE = {torch.float64: 1e3, torch.float32: 3e3, torch.bfloat16: 1e3, torch.float16: 30.0}


def ref_softmax(logits: torch.Tensor) -> torch.Tensor:
    shifted = logits - logits.max(1, keepdim=True).values
    return shifted.exp() / shifted.exp().sum(1, keepdim=True)


def ref_weights(gate64, x64, experts, k):
    chosen = ref_softmax(x64 @ gate64.t()).gather(1, experts)
    return chosen / chosen.sum(1, keepdim=True) if k > 1 else chosen


# Fixed configurations run through the drawn cases' checks, so that what those check (the
# tokens' gradient, a column-major x, ties) is graded on every seed, not only where a draw has it.
ROUTER_FIXED = [
    dict(tokens=9, num_experts=4, k=2, hidden=5, dtype=torch.float32, tie="none", scale=1.0, column_major=False,
         salt=4242, replay="(a fixed case)", kind="fixed"),
    dict(tokens=6, num_experts=3, k=1, hidden=3, dtype=torch.float64, tie="duplicate expert", scale=1.0,
         column_major=True, salt=17, replay="(a fixed case)", kind="fixed"),
]


def router_on_rank(drawn: list = ()) -> None:
    from labkit.moe import load_balancing_loss, route, router_z_loss
    rank = dist.get_rank()
    router_drawn_on_rank(ROUTER_FIXED + list(drawn))
    for dtype in DTYPES:  # logits where exp overflows: logsumexp and softmax must not
        scale = LARGE[dtype]
        what = f"moe.router: rank {rank}, {NAMES[dtype]}, logits of about {scale:g} (exp overflows)"
        gen = torch.Generator().manual_seed(77 + rank)
        logits = (torch.randn(R_TOKENS, R_EXPERTS, generator=gen, dtype=torch.float64) * scale).to(dtype)
        logits.requires_grad_(True)
        assert torch.isinf(logits.double().exp().to(dtype)).any(), "test set-up: exp should overflow"
        z = router_z_loss(logits)
        l64 = logits.detach().double().requires_grad_(True)
        ref_z = (torch.logsumexp(l64, 1) ** 2).mean()
        ref_z.backward()
        assert z.dtype == dtype and torch.isfinite(z), f"{what}: z-loss must be a finite {dtype}, got {z}"
        near(z, ref_z.detach().to(dtype), what + ": z-loss")
        z.backward()
        near(logits.grad, l64.grad.to(dtype), what + ": z-loss gradient 2 lse softmax / T")
        if dtype in (torch.float64, torch.float32):  # and route's softmax, k = 1 (a unique top)
            x = torch.randn(R_TOKENS, R_HIDDEN, generator=gen, dtype=torch.float64)
            gate = torch.randn(R_EXPERTS, R_HIDDEN, generator=gen, dtype=torch.float64) * scale / 2
            experts, weights, probs, logits = route(x.to(dtype), gate.to(dtype), 1)
            ref_logits = x.to(dtype).double() @ gate.to(dtype).double().t()
            assert torch.isinf(ref_logits.exp().to(dtype)).any(), "test set-up: exp of the logits should overflow"
            ref_probs = ref_softmax(ref_logits)
            near(probs, ref_probs.to(dtype), what + ": route's softmax")
            assert torch.equal(experts, ref_probs.argmax(1, keepdim=True)), what + ": route's top-1"
            near(weights, ref_probs.max(1, keepdim=True).values.to(dtype), what + ": route's top-1 weight")
            # k = 3 where most probabilities underflow to exactly 0: the second and third picks are
            # ties at 0, still three DISTINCT experts, each at least as probable as any left out
            experts, weights, probs, logits = route(x.to(dtype), gate.to(dtype), 3)
            mine = probs.detach().double()
            assert ((mine == 0).sum(1) >= 2).any(), "test set-up: some token's probabilities should underflow to 0"
            assert all(len(set(row)) == 3 for row in experts.tolist()), \
                f"{what}: route's top-3 must be 3 distinct experts per token (ties at probability 0), got {experts.tolist()}"
            picked = mine.gather(1, experts)
            rest = mine.scatter(1, experts, float("-inf")).max(1).values
            assert (picked[:, :-1] >= picked[:, 1:]).all() and (picked[:, -1] >= rest).all(), \
                f"{what}: route's top-3 must be the 3 most probable experts, most probable first, got {experts.tolist()}"
    configs = [(dtype, k, False) for dtype in DTYPES for k in (1, 2, 3, R_EXPERTS)]
    configs += [(dtype, k, True) for dtype in (torch.float64, torch.float32) for k in (1, 2)]
    for salt, (dtype, k, uneven) in enumerate(configs):
        what = f"moe.router: rank {rank}, {NAMES[dtype]}, k={k}, E={R_EXPERTS}, T={R_TOKENS}" + (
            ", uneven (every token on expert 0)" if uneven else "")
        gen = torch.Generator().manual_seed(1000 * rank + salt)
        x = torch.randn(R_TOKENS, R_HIDDEN, generator=gen, dtype=torch.float64)
        gate = torch.randn(R_EXPERTS, R_HIDDEN, generator=gen, dtype=torch.float64)
        if uneven:
            x, gate[0] = x.abs() + 1.0, gate[0].abs() + 3.0
        x, gate = x.to(dtype), gate.to(dtype).requires_grad_(True)
        x64, gate64 = x.double(), gate.detach().double()
        experts, weights, probs, logits = route(x, gate, k)
        ref_logits = x64 @ gate64.t()
        ref_probs = ref_softmax(ref_logits)
        for name, t in (("weights", weights), ("probs", probs), ("logits", logits)):
            assert isinstance(t, torch.Tensor) and t.dtype == dtype, \
                f"{what}: {name} must be {dtype} (the dtype of x), got {getattr(t, 'dtype', type(t))}"
        assert experts.dtype == torch.int64 and experts.shape == (R_TOKENS, k), \
            f"{what}: experts must be int64 [T, k] = {(R_TOKENS, k)}, got {experts.dtype} {tuple(experts.shape)}"
        near(logits, ref_logits.to(dtype), what + ": logits = x W^T")
        near(probs, ref_probs.to(dtype), what + ": softmax probabilities")
        if dtype in (torch.float64, torch.float32):
            order = torch.sort(ref_probs, dim=1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(experts, order), \
                f"{what}: experts must be the k most probable, most probable first\n got {experts.tolist()}\n want {order.tolist()}"
        else:  # low precision: near ties may go either way; the choice must be a top-k of your probs, in order
            mine = probs.detach().double()
            picked = mine.gather(1, experts)
            rest = mine.scatter(1, experts, float("-inf")).max(1).values if k < R_EXPERTS else None
            assert (picked[:, :-1] >= picked[:, 1:]).all(), f"{what}: experts must come most probable first"
            assert rest is None or (picked[:, -1] >= rest).all(), f"{what}: experts must be the k most probable"
            assert all(len(set(row)) == k for row in experts.tolist()), f"{what}: k distinct experts per token"
        want_w = ref_weights(gate64, x64, experts, k)
        near(weights, want_w.to(dtype), what + (": k = 1 weight = the chosen probability (not renormalised: Switch)"
                                                if k == 1 else ": weights renormalised over the k chosen"))
        aux = load_balancing_loss(probs, experts, R_EXPERTS)
        f = torch.bincount(experts.reshape(-1), minlength=R_EXPERTS).double() / (R_TOKENS * k)
        ref_aux = R_EXPERTS * (f * ref_probs.mean(0)).sum()
        assert aux.dtype == dtype and aux.dim() == 0, f"{what}: aux must be a {dtype} scalar, got {aux.dtype} {tuple(aux.shape)}"
        near(aux, ref_aux.to(dtype), what + ": load-balancing loss E * sum f_e P_e, f_e = count_e / (T k)")
        z = router_z_loss(logits)
        ref_z = (torch.logsumexp(ref_logits, 1) ** 2).mean()
        assert z.dtype == dtype and z.dim() == 0, f"{what}: z-loss must be a {dtype} scalar, got {z.dtype} {tuple(z.shape)}"
        near(z, ref_z.to(dtype), what + ": z-loss mean(logsumexp^2)")
        # gradients: the task loss through the weights, the aux loss through P only, the z-loss
        c = torch.randn(R_TOKENS, k, generator=gen, dtype=torch.float64)
        task_grad, = torch.autograd.grad((weights * c.to(dtype)).sum(), gate, retain_graph=True)
        aux_grad, = torch.autograd.grad(aux, gate, retain_graph=True)
        z_grad, = torch.autograd.grad(z, gate)
        g = gate64.clone().requires_grad_(True)
        ref_task, = torch.autograd.grad((ref_weights(g, x64, experts, k) * c).sum(), g)
        g = gate64.clone().requires_grad_(True)
        ref_aux_grad, = torch.autograd.grad(R_EXPERTS * (f * ref_softmax(x64 @ g.t()).mean(0)).sum(), g)
        g = gate64.clone().requires_grad_(True)
        ref_z_grad, = torch.autograd.grad((torch.logsumexp(x64 @ g.t(), 1) ** 2).mean(), g)
        if k == 1 and not uneven:
            assert task_grad.abs().max() > 0, \
                f"{what}: the router gets no gradient from the task loss (a renormalised top-1 weight is always 1)"
        near(task_grad, ref_task.to(dtype), what + ": gate gradient of the task loss sum(weights * c)")
        if k < R_EXPERTS:  # at k = E every f_e is 1/E and the aux loss is the constant 1: its gradient is rounding
            near(aux_grad, ref_aux_grad.to(dtype), what + ": gate gradient of the aux loss (through P_e only)")
        near(z_grad, ref_z_grad.to(dtype), what + ": gate gradient of the z-loss")


# ----------------------------------------------------------------------------- router, drawn configurations

BIG_LOGITS = {torch.float64: 1000.0, torch.float32: 10.0, torch.bfloat16: 1.0, torch.float16: 1.0}  # saturating scale per dtype
ROUTER_TIES = ("none", "duplicate expert", "zero tokens")


def draw_router(n: int) -> list:
    """Configurations of ``route`` / ``load_balancing_loss`` / ``router_z_loss`` from their whole
    documented space, for one launch at world size n: T 1-17 tokens, E 1-8 experts, any k from 1
    to E, H 1-7, the four dtypes, x row- or column-major, logits of ordinary size or saturating
    (probabilities that underflow to 0 in float64 and float32: ties at 0), and exact ties (two
    experts with the same gate row; tokens of zeros, every expert at 1/E)."""
    rng = configs.rng(f"moe.router:{n}")
    cases = []
    for i in range(configs.budget(ci=24, long=200)):
        num_experts, dtype = rng.randint(1, 8), rng.choice(DTYPES)
        cases.append(dict(tokens=rng.randint(1, 17), num_experts=num_experts, k=rng.randint(1, num_experts),
                          hidden=rng.randint(1, 7), dtype=dtype, tie=rng.choice(ROUTER_TIES),
                          scale=rng.choice((1.0, BIG_LOGITS[dtype])), column_major=rng.random() < 0.3,
                          salt=rng.randrange(2 ** 31), replay=configs.replay(f"moe.router, world size {n}, drawn case {i}")))
    return cases


def router_drawn_case(c: dict, rank: int) -> None:
    """One drawn configuration, against float64 references of the same (rounded) inputs: outputs,
    dtypes and shapes; the experts a top-k of the exact probabilities, most probable first (any
    order among exact ties); the weights of the experts chosen; aux and z-loss; and the gradients
    of the gate AND of the tokens for random incoming gradients on weights, probs and logits and
    random weights on aux and z-loss (one backward through every output)."""
    from labkit.moe import load_balancing_loss, route, router_z_loss
    tokens, num_experts, k, hidden, dtype = (c[key] for key in ("tokens", "num_experts", "k", "hidden", "dtype"))
    what = (f"moe.router ({c.get('kind', 'drawn')}): rank {rank}, {NAMES[dtype]}, T={tokens}, E={num_experts}, k={k}, H={hidden}, "
            f"ties: {c['tie']}, logit scale {c['scale']:g}{', x column-major' if c['column_major'] else ''} {c['replay']}")
    gen = torch.Generator().manual_seed(c["salt"] + rank)
    x64 = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    gate64 = torch.randn(num_experts, hidden, generator=gen, dtype=torch.float64) * c["scale"]
    if c["tie"] == "duplicate expert" and num_experts > 1:
        i, j = torch.randperm(num_experts, generator=gen)[:2].tolist()
        gate64[j] = gate64[i]
    if c["tie"] == "zero tokens":
        x64[::2] = 0.0  # all E logits 0: every probability 1/E
    x = x64.to(dtype)
    if c["column_major"]:
        x = x.t().contiguous().t()
    x.requires_grad_(True)
    gate = gate64.to(dtype).requires_grad_(True)
    xd, gd = x.detach().double(), gate.detach().double()  # the inputs route sees, exactly, in float64
    experts, weights, probs, logits = route(x, gate, k)
    for name, t in (("weights", weights), ("probs", probs), ("logits", logits)):
        assert isinstance(t, torch.Tensor) and t.dtype == dtype, \
            f"{what}: {name} must be {dtype} (the dtype of x), got {getattr(t, 'dtype', type(t))}"
    for name, t, shape in (("weights", weights, (tokens, k)), ("probs", probs, (tokens, num_experts)),
                           ("logits", logits, (tokens, num_experts))):
        assert tuple(t.shape) == shape, f"{what}: {name} must be {shape}, got {tuple(t.shape)}"
    assert isinstance(experts, torch.Tensor) and experts.dtype == torch.int64 and tuple(experts.shape) == (tokens, k), \
        f"{what}: experts must be int64 [T, k] = {(tokens, k)}, got {getattr(experts, 'dtype', type(experts))} " \
        f"{tuple(getattr(experts, 'shape', ()))}"
    ref_logits = xd @ gd.t()
    ref_probs = ref_softmax(ref_logits)
    near(logits, ref_logits.to(dtype), what + ": logits = x W^T")
    near(probs, ref_probs.to(dtype), what + ": softmax probabilities")
    assert ((experts >= 0) & (experts < num_experts)).all() and all(len(set(row)) == k for row in experts.tolist()), \
        f"{what}: k distinct experts in [0, E) per token, got {experts.tolist()}"
    mine = probs.detach().double()
    picked = mine.gather(1, experts)
    assert (picked[:, :-1] >= picked[:, 1:]).all(), f"{what}: experts must come most probable first, got {experts.tolist()}"
    if k < num_experts:
        rest = mine.scatter(1, experts, float("-inf")).max(1).values
        assert (picked[:, -1] >= rest).all(), f"{what}: experts must be the k most probable (of your probs)"
    near(ref_probs.gather(1, experts).to(dtype), ref_probs.topk(k, dim=1).values.to(dtype),
         what + ": the chosen experts' exact probabilities must be the k largest (a top-k, any order among ties)")
    near(weights, ref_weights(gd, xd, experts, k).to(dtype),
         what + (": k = 1 weight = the chosen probability" if k == 1 else ": weights renormalised over the k chosen"))
    aux, z = load_balancing_loss(probs, experts, num_experts), router_z_loss(logits)
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).double() / (tokens * k)
    assert aux.dtype == dtype and aux.dim() == 0 and z.dtype == dtype and z.dim() == 0, \
        f"{what}: aux and z-loss must be {dtype} scalars, got {aux.dtype} {tuple(aux.shape)}, {z.dtype} {tuple(z.shape)}"
    near(aux, (num_experts * (f * ref_probs.mean(0)).sum()).to(dtype), what + ": load-balancing loss E sum f_e P_e")
    near(z, (torch.logsumexp(ref_logits, 1) ** 2).mean().to(dtype), what + ": z-loss mean(logsumexp^2)")
    # one backward through every output, each with its own random incoming gradient (at k = E the aux
    # loss is the constant 1: its gradient is rounding alone, so it gets none)
    cw, cp, cl = (torch.randn(*shape, generator=gen, dtype=torch.float64)
                  for shape in ((tokens, k), (tokens, num_experts), (tokens, num_experts)))
    a_aux = 0.0 if k == num_experts else torch.rand((), generator=gen, dtype=torch.float64).item() + 0.5
    a_z = torch.rand((), generator=gen, dtype=torch.float64).item() + 0.5
    outputs = (weights, probs, logits, aux, z)
    for name, t in zip(("weights", "probs", "logits", "aux", "z-loss"), outputs):
        assert t.requires_grad, f"{what}: {name} must carry a gradient to the gate and the tokens"
    incoming = [cw.to(dtype), cp.to(dtype), cl.to(dtype), torch.tensor(a_aux, dtype=dtype), torch.tensor(a_z, dtype=dtype)]
    gate_grad, x_grad = torch.autograd.grad(outputs, (gate, x), incoming, allow_unused=True)
    g, xr = gd.clone().requires_grad_(True), xd.clone().requires_grad_(True)
    r_logits = xr @ g.t()
    r_probs = ref_softmax(r_logits)
    r_chosen = r_probs.gather(1, experts)
    r_weights = r_chosen / r_chosen.sum(1, keepdim=True) if k > 1 else r_chosen
    ref_total = ((r_weights * cw).sum() + (r_probs * cp).sum() + (r_logits * cl).sum()
                 + a_aux * num_experts * (f * r_probs.mean(0)).sum() + a_z * (torch.logsumexp(r_logits, 1) ** 2).mean())
    ref_gate, ref_x, ref_dlogits = torch.autograd.grad(ref_total, (g, xr, r_logits))
    # each gradient sums one part per token (gate) or per expert (x): parts that cancel are only as
    # exact as their own rounding, so the tolerance scales with the sum of their magnitudes
    # (bfloat16, one expert, parts cancelling: LABKIT_SEED=669535735)
    terms = {"gate": ref_dlogits.abs().t() @ xd.abs(), "tokens x": ref_dlogits.abs() @ gd.abs()}
    for name, got, want in (("gate", gate_grad, ref_gate), ("tokens x", x_grad, ref_x)):
        assert got is not None, f"{what}: the {name} got no gradient (route is a function of both)"
        near(got, want.to(dtype), what + f": {name} gradient for random incoming gradients on weights, probs, logits, "
                                         f"aux (x {a_aux:.3g}) and z-loss (x {a_z:.3g})", terms=terms[name])


def router_drawn_on_rank(cases: list) -> None:
    rank = dist.get_rank()
    for c in cases:
        router_drawn_case(c, rank)


# ----------------------------------------------------------------------------- capacity

def capacity_on_rank(drawn: dict | None = None) -> None:
    from labkit.moe import expert_capacity, keep_mask
    rank = dist.get_rank()
    if drawn:
        capacity_drawn_on_rank(drawn)
    cases = [(12, 4, 2, 1.0), (10, 4, 2, 1.25), (7, 3, 1, 0.5), (9, 8, 2, 2.0), (13, 5, 3, 1.0), (8, 4, 4, 1.0),
             (10, 4, 3, 0.2), (6, 4, 2, 0.5), (16, 4, 1, 0.25), (20, 8, 2, 1.5), (5, 5, 5, 1.0), (11, 3, 3, 0.75),
             (29, 7, 7, 1.0),  # C k T / E = 29 exactly, but 29 / 7 * 7 rounds to 29.000000000000004
             (6, 2, 2, 4.0)]   # C k > E: an expert may take more slots (24) than there are tokens (6)
    for tokens, experts, k, factor in cases:
        want = math.ceil(Fraction(factor) * k * tokens / experts)
        got = expert_capacity(tokens, experts, k, factor)
        assert isinstance(got, int) and not isinstance(got, bool) and got == want, (
            f"moe.capacity: T={tokens}, E={experts}, k={k}, C={factor}: {got!r}, want the int ceil(C k T / E) = {want}")
    for k in (1, 2, 3):
        assert expert_capacity(12, 4, k, None) is None, f"moe.capacity: k={k}, capacity_factor=None is dropless (None)"
    for bad in (0, -1.0):
        with pytest.raises(ValueError):
            expert_capacity(12, 4, 2, bad)
    salt = 0
    for num_experts, k, tokens in [(5, 1, 7), (5, 2, 11), (5, 3, 13), (5, 5, 7), (4, 2, 13), (6, 3, 11)]:
        used = max(k, num_experts - 2)  # the last experts chosen by nobody (unless k needs them)
        for factor in (0.5, 1.0, 2.0, None, "fullest", "fullest - 1"):
            salt += 1
            gen = torch.Generator().manual_seed(50 + salt + 1000 * rank)
            choices = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(tokens)])
            choices[::2, 0] = 0  # crowd expert 0 with first choices
            if salt % 2:  # every other table column-major: [T, k] need not be row-major
                choices = choices.t().contiguous().t()
            fullest = torch.bincount(choices.reshape(-1)).max().item()
            if isinstance(factor, str):
                capacity = fullest if factor == "fullest" else fullest - 1
            else:
                capacity = expert_capacity(tokens, num_experts, k, factor)
            mask = keep_mask(choices, num_experts, capacity)
            taken, want = [0] * num_experts, torch.zeros_like(choices, dtype=torch.bool)
            for t in range(tokens):
                for j in range(k):
                    e = choices[t, j].item()
                    if capacity is None or taken[e] < capacity:
                        taken[e] += 1
                        want[t, j] = True
            what = (f"moe.capacity: rank {rank}, E={num_experts}, k={k}, T={tokens}, capacity {capacity} ({factor})"
                    + (", choices column-major" if salt % 2 else ""))
            if factor == "fullest":
                assert want.all(), "test set-up: nothing should drop at the fullest count"
            if factor == "fullest - 1":
                assert (~want).sum() == 1, "test set-up: one choice should drop"
            assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == choices.shape, \
                f"{what}: keep_mask must be bool {tuple(choices.shape)}, got {getattr(mask, 'dtype', type(mask))}"
            assert torch.equal(mask, want), (
                f"{what}: keep_mask must keep each expert's first choices in (token, slot) order\n"
                f" got  {mask.int().tolist()}\n want {want.int().tolist()}")


# ----------------------------------------------------------------------------- capacity, drawn configurations

def draw_capacity_factor(rng: random.Random) -> float:
    """A capacity factor from the whole documented space (any float > 0): dyadic (exact in binary,
    so C k T / E may be an exact integer), tiny (1e-6 ... 0.05: the capacity is 1), two decimals
    (0.05 ... 4), or large (up to 16: an expert may take more than T)."""
    kind = rng.random()
    if kind < 0.35:
        return rng.randint(1, 64) / 2 ** rng.randint(0, 6)
    if kind < 0.5:
        return rng.choice((1e-6, 1e-3, 0.01, rng.uniform(1e-6, 0.05)))
    if kind < 0.85:
        return round(rng.uniform(0.05, 4.0), 2)
    return round(rng.uniform(4.0, 16.0), 1)


def exact_capacity(tokens: int, num_experts: int, k: int, factor: float):
    """ceil(C k T / E) with C the float's exact value, or None when the exact quotient is not an
    integer but within 1e-9 of one (its rounding depends on the order of the float operations:
    no implementation can be told wrong there)."""
    q = Fraction(factor) * k * tokens / num_experts
    if q.denominator != 1 and min(q - math.floor(q), math.ceil(q) - q) < Fraction(1, 10 ** 9) * max(q, 1):
        return None
    return math.ceil(q)


def draw_capacity(n: int) -> dict:
    """For one launch: (T, E, k, C) for ``expert_capacity``, more than half of them exact integers C k T / E,
    most with E not dividing T (the quotient must not be rounded up), and [T, k] choice tables for
    ``keep_mask`` (E 1-8, any k, T 1-40, skewed or not, row- or column-major) with capacities 1,
    drawn, from a drawn factor, the fullest expert's count, one less, and None."""
    rng = configs.rng(f"moe.capacity:{n}")
    formula = []
    while len(formula) < configs.budget(ci=400, long=5000):
        num_experts = rng.randint(1, 64)
        k = rng.randint(1, num_experts)
        if rng.random() < 0.6:  # an exact integer: C dyadic, T a multiple of E / gcd
            factor = rng.randint(1, 64) / 2 ** rng.randint(0, 6)
            step = (Fraction(factor) * k / num_experts).denominator
            tokens = step * rng.randint(1, max(1, 4096 // step))
            if tokens > 4096:
                continue
        else:
            factor, tokens = draw_capacity_factor(rng), rng.randint(1, 4096)
        want = exact_capacity(tokens, num_experts, k, factor)
        if want is not None:
            formula.append((tokens, num_experts, k, factor, want))
    masks = []
    for i in range(configs.budget(ci=24, long=300)):
        num_experts = rng.randint(1, 8)
        masks.append(dict(num_experts=num_experts, k=rng.randint(1, num_experts), tokens=rng.randint(1, 40),
                          skewed=rng.random() < 0.5, column_major=rng.random() < 0.3,
                          capacity=rng.choice(("1", "drawn", "factor", "fullest", "fullest - 1", None)),
                          factor=draw_capacity_factor(rng), salt=rng.randrange(2 ** 31),
                          replay=configs.replay(f"moe.capacity, world size {n}, drawn mask {i}")))
    return dict(formula=formula, masks=masks, replay=configs.replay(f"moe.capacity, world size {n}"))


def loop_keep(choices: torch.Tensor, num_experts: int, capacity) -> torch.Tensor:
    """The stated rule as a loop: each expert takes choices in (token, slot) order until full."""
    taken, keep = [0] * num_experts, torch.zeros_like(choices, dtype=torch.bool)
    for t in range(choices.shape[0]):
        for j in range(choices.shape[1]):
            e = choices[t, j].item()
            if capacity is None or taken[e] < capacity:
                taken[e] += 1
                keep[t, j] = True
    return keep


def capacity_drawn_on_rank(drawn: dict) -> None:
    from labkit.moe import expert_capacity, keep_mask
    rank = dist.get_rank()
    for tokens, num_experts, k, factor, want in drawn["formula"]:
        got = expert_capacity(tokens, num_experts, k, factor)
        assert isinstance(got, int) and not isinstance(got, bool) and got == want, (
            f"moe.capacity (drawn): T={tokens}, E={num_experts}, k={k}, C={factor!r}: {got!r}, want the int "
            f"ceil(C k T / E) = {want} (C k T / E = {float(Fraction(factor) * k * tokens / num_experts)!r}) {drawn['replay']}")
    for c in drawn["masks"]:
        num_experts, k, tokens = c["num_experts"], c["k"], c["tokens"]
        gen = torch.Generator().manual_seed(c["salt"] + rank)
        choices = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)])
        if c["skewed"] and num_experts > 1:  # crowd expert 0: swap it into slot 0 of every other token
            for t in range(0, tokens, 2):
                row = choices[t]
                where = (row == 0).nonzero()
                if where.numel():
                    row[where[0, 0]] = row[0].clone()
                row[0] = 0
        fullest = torch.bincount(choices.reshape(-1)).max().item()
        capacity = {"1": 1, "drawn": 1 + int(torch.randint(fullest + 1, (), generator=gen)), "fullest": fullest,
                    "fullest - 1": max(1, fullest - 1), None: None,
                    "factor": exact_capacity(tokens, num_experts, k, c["factor"]) or 1}[c["capacity"]]
        if c["column_major"]:
            choices = choices.t().contiguous().t()
        want = loop_keep(choices, num_experts, capacity)
        what = (f"moe.capacity (drawn): keep_mask on rank {rank}, E={num_experts}, k={k}, T={tokens}, capacity {capacity} "
                f"({c['capacity']}){', skewed' if c['skewed'] else ''}{', experts column-major' if c['column_major'] else ''} "
                f"{c['replay']}")
        mask = keep_mask(choices, num_experts, capacity)
        assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape == choices.shape, \
            f"{what}: keep_mask must be bool {tuple(choices.shape)}, got {getattr(mask, 'dtype', type(mask))} " \
            f"{tuple(getattr(mask, 'shape', ()))}"
        assert torch.equal(mask, want), (
            f"{what}: keep_mask must keep each expert's first choices in (token, slot) order\n"
            f" choices {choices.tolist()}\n got  {mask.int().tolist()}\n want {want.int().tolist()}")


# ----------------------------------------------------------------------------- dispatch

D_HIDDEN = 5
PATTERNS = {  # rows group rank s sends to group rank d, of a group of m
    "uneven": lambda s, d, m: (s + 2 * d) % 3 + (1 if d == 0 else 0),
    "last rank sends nothing": lambda s, d, m: 0 if s == m - 1 else (s + 1) * (d + 2) % 4,
    "rank 0 receives nothing": lambda s, d, m: 0 if d == 0 else s + d,
}


# Two calls forward before either backward (the layer's dispatch and combine), with other splits
# for every rank at every world size, graded on every seed (the drawn cases may not differ so).
DISPATCH_FIXED = [
    dict(group=0, dtype=torch.float32, hidden=3, strided=False, local=2, counts_strided=False, salt=31,
         splits=([[1, 2, 0, 3], [2, 0, 1, 1], [0, 3, 2, 1], [1, 1, 1, 0]],
                 [[2, 0, 1, 1], [3, 1, 0, 2], [1, 1, 3, 0], [0, 2, 2, 1]]),
         counts=[[5, 0, 7, 1, 2, 9, 0, 4], [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 9, 9, 1, 1, 2, 2], [3, 1, 4, 1, 5, 9, 2, 6]],
         replay="(a fixed case)", kind="fixed"),
    dict(group=0, dtype=torch.float64, hidden=2, strided=True, local=1, counts_strided=True, salt=32,
         splits=([[3, 1, 2, 0], [0, 2, 1, 2], [2, 2, 0, 1], [1, 0, 3, 1]],
                 [[1, 3, 0, 2], [2, 1, 1, 0], [0, 1, 2, 3], [2, 2, 0, 1]]),
         counts=[[4, 0, 2, 1], [0, 0, 3, 5], [7, 1, 0, 2], [1, 2, 3, 4]],
         replay="(a fixed case)", kind="fixed"),
]


def dispatch_on_rank(drawn: list = ()) -> None:
    from labkit.moe import AllToAll, exchange_counts
    rank = dist.get_rank()
    dispatch_drawn_on_rank(DISPATCH_FIXED + list(drawn))
    for group_name, members, group in groups_of_world():
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        for dtype in DTYPES:
            for pattern, rows_to in PATTERNS.items():
                send = [rows_to(me, d, m) for d in range(m)]
                recv = [rows_to(s, me, m) for s in range(m)]
                what = (f"moe.dispatch: AllToAll on rank {rank}, {group_name}, {NAMES[dtype]}, {pattern}: "
                        f"sends {send}, receives {recv}")
                base = torch.cat([torch.full((send[d], 2 * D_HIDDEN), 100.0 * me + d) for d in range(m)])
                base += torch.arange(2 * D_HIDDEN)
                x = base.to(dtype)[:, ::2].requires_grad_(True)  # non-contiguous
                scale = torch.arange(1, sum(recv) + 1, dtype=dtype).unsqueeze(1)
                with CommTracer() as tracer:
                    out = AllToAll.apply(x, recv, send, group)
                    (out * scale).sum().backward()
                want = torch.cat([torch.full((recv[s], 2 * D_HIDDEN), 100.0 * s + me) for s in range(m)])
                want = (want + torch.arange(2 * D_HIDDEN))[:, ::2].to(dtype)
                assert isinstance(out, torch.Tensor) and out.dtype == dtype, f"{what}: output must be {dtype}"
                assert_close(out, want, what + ": the blocks received, in group-rank order", rtol=0, atol=0)
                # row i of the receiver's output has gradient i + 1: rows sent to d sit after those of lower ranks
                grad = torch.cat([torch.arange(1, send[d] + 1, dtype=torch.float64) + sum(rows_to(s, d, m) for s in range(me))
                                  for d in range(m)]).unsqueeze(1).expand(-1, D_HIDDEN).to(dtype)
                assert_close(x.grad, grad, what + ": backward sends each row's gradient back to its sender",
                             rtol=0, atol=0)
                size = D_HIDDEN * x.element_size()
                assert_sequence(tracer, 2 * [Op("all_to_all", max(sum(send), sum(recv)) * size, members)],
                                what + f" (one all-to-all forward, one back, in group {members}, "
                                       f"max(rows sent, received) x H x {x.element_size()} B)")
                assert [e.in_backward for e in tracer.events] == [False, True], \
                    f"{what}: the second all-to-all must run in backward"
        for local in (1, 2, 3):
            counts = torch.tensor([(10 * me + e) * (e % 3 != 1) for e in range(local * m)], dtype=torch.int64)
            if local == 2:  # a strided view (a column of a [E, 2] table)
                counts = torch.stack([counts, -counts], dim=1)[:, 0]
            with CommTracer() as tracer:
                got = exchange_counts(counts, group)
            want = torch.tensor([[(10 * s + me * local + e) * ((me * local + e) % 3 != 1) for e in range(local)]
                                 for s in range(m)], dtype=torch.int64)
            what = f"moe.dispatch: exchange_counts on rank {rank}, {group_name}, {local} experts per rank" + (
                ", counts a strided view" if local == 2 else "")
            assert isinstance(got, torch.Tensor) and got.dtype == torch.int64 and torch.equal(got, want), \
                f"{what}: row s = what group rank s sends to my experts\n got {got!r}\n want {want.tolist()}"
            assert_sequence(tracer, [Op("all_to_all", counts.nbytes, members)],
                            what + f" (one all-to-all of the E int64 counts in group {members})")


# ----------------------------------------------------------------------------- dispatch, drawn configurations

GROUPS_AT = {1: 1, 2: 1, 3: 2, 4: 5}  # len(groups_of_world()) at each world size


def draw_splits(rng: random.Random) -> list:
    """[4][4] rows group rank s sends to group rank d (the top-left m x m is used): 0-5 each, a
    third of them 0 (ranks that send or receive nothing, in whole or to some)."""
    return [[0 if rng.random() < 0.35 else rng.randint(1, 5) for _ in range(4)] for _ in range(4)]


def draw_dispatch(n: int) -> list:
    """Configurations of ``AllToAll`` and ``exchange_counts`` for one launch at world size n: a group
    of the world, a dtype, H 1-6, two calls with their own uneven splits drawn per rank (zeros
    included; the second half the time the first's blocks re-dealt between senders, so that every
    receiver gets the same number of rows as in the first call), a row- or column-major input and
    incoming gradient, E/N 1-3 counts of 0 ... 1e12 (zeros included), plain or a strided view."""
    rng = configs.rng(f"moe.dispatch:{n}")
    cases = []
    for i in range(configs.budget(ci=8, long=80)):
        first = draw_splits(rng)
        if rng.random() < 0.5:
            order = rng.sample(range(4), 4)
            second = [first[order[s]][:] for s in range(4)]
        else:
            second = draw_splits(rng)
        local = rng.randint(1, 3)
        cases.append(dict(group=rng.randrange(GROUPS_AT[n]), dtype=rng.choice(DTYPES), hidden=rng.randint(1, 6),
                          splits=(first, second), strided=rng.random() < 0.4, local=local,
                          counts=[[0 if rng.random() < 0.3 else rng.randint(1, 10 ** rng.randint(1, 12))
                                   for _ in range(4 * local)] for _ in range(4)],
                          counts_strided=rng.random() < 0.5, salt=rng.randrange(2 ** 31),
                          replay=configs.replay(f"moe.dispatch, world size {n}, drawn case {i}")))
    return cases


def dispatch_drawn_on_rank(cases: list) -> None:
    """Each drawn case: two ``AllToAll`` calls with their own splits, both forward before one
    backward through both (as the layer's dispatch and combine), random rows and random incoming
    gradients that every rank rebuilds from the case's seed: the rows received and the gradients
    sent back exact, the first call's output unchanged by the second call, one all-to-all per call
    each way in the group; then ``exchange_counts`` of the drawn counts, exact."""
    from labkit.moe import AllToAll, exchange_counts
    rank = dist.get_rank()
    groups = groups_of_world()
    for c in cases:
        group_name, members, group = groups[c["group"]]
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        dtype, hidden = c["dtype"], c["hidden"]
        gen = torch.Generator().manual_seed(c["salt"])  # the same on every rank: each rebuilds every rank's rows
        calls = []
        for rows in c["splits"]:
            rows = [row[:m] for row in rows[:m]]
            xs = [torch.randn(sum(rows[s]), hidden, generator=gen, dtype=torch.float64).to(dtype) for s in range(m)]
            gs = [torch.randn(sum(rows[s][d] for s in range(m)), hidden, generator=gen, dtype=torch.float64).to(dtype)
                  for d in range(m)]
            x, g = xs[me].clone(), gs[me].clone()
            if c["strided"]:
                x, g = x.t().contiguous().t(), g.t().contiguous().t()
            calls.append(dict(rows=rows, xs=xs, gs=gs, x=x.requires_grad_(True), g=g,
                              send=rows[me], recv=[rows[s][me] for s in range(m)]))
        what = (f"moe.dispatch ({c.get('kind', 'drawn')}): AllToAll on rank {rank}, {group_name}, {NAMES[dtype]}, H={hidden}, "
                f"call 1 sends {calls[0]['send']} receives {calls[0]['recv']}, call 2 sends {calls[1]['send']} "
                f"receives {calls[1]['recv']}{', column-major rows and gradients' if c['strided'] else ''} {c['replay']}")
        with CommTracer() as tracer:
            outs = [AllToAll.apply(call["x"], call["recv"], call["send"], group) for call in calls]
            firsts = outs[0].detach().clone()
            torch.autograd.backward(outs, [call["g"] for call in calls])
        for i, (call, out) in enumerate(zip(calls, outs)):
            rows, xs, gs = call["rows"], call["xs"], call["gs"]
            want = torch.cat([xs[s][sum(rows[s][:me]):sum(rows[s][:me + 1])] for s in range(m)])
            assert isinstance(out, torch.Tensor) and out.dtype == dtype, f"{what}: call {i + 1}'s rows must be {dtype}"
            assert_close(out, want, what + f": call {i + 1}: the blocks received, in group-rank order", rtol=0, atol=0)
            back = torch.cat([gs[d][sum(rows[s][d] for s in range(me)):sum(rows[s][d] for s in range(me + 1))]
                              for d in range(m)])
            assert_close(call["x"].grad, back, what + f": call {i + 1}: backward sends each row's incoming gradient "
                                                      f"back to its sender (both calls' backwards after both forwards)",
                         rtol=0, atol=0)
        assert_close(outs[0].detach(), firsts, what + ": call 1's rows must not change when call 2 runs (its own buffer)",
                     rtol=0, atol=0)
        size = hidden * torch.tensor([], dtype=dtype).element_size()
        want_ops = [Op("all_to_all", max(sum(call["send"]), sum(call["recv"])) * size, members) for call in calls]
        assert_ops(tracer, want_ops + want_ops, what + f" (one all-to-all per call each way, in group {members})")
        assert [e.in_backward for e in tracer.events] == [False, False, True, True], \
            f"{what}: two all-to-alls forward, then two in backward"
        local = c["local"]
        table = [torch.tensor(row[:m * local], dtype=torch.int64) for row in c["counts"][:m]]
        counts = table[me].clone()
        if c["counts_strided"]:
            counts = torch.stack([counts, -counts], dim=1)[:, 0]
        with CommTracer() as tracer:
            got = exchange_counts(counts, group)
        want = torch.stack([table[s][me * local:(me + 1) * local] for s in range(m)])
        where = (f"moe.dispatch ({c.get('kind', 'drawn')}): exchange_counts on rank {rank}, {group_name}, {local} experts per rank, counts "
                 f"{counts.tolist()}{' (a strided view)' if c['counts_strided'] else ''} {c['replay']}")
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int64 and torch.equal(got, want), \
            f"{where}: row s = what group rank s sends to my experts\n got {got!r}\n want {want.tolist()}"
        assert_sequence(tracer, [Op("all_to_all", m * local * 8, members)],
                        where + f" (one all-to-all of the E int64 counts in group {members})")


# ----------------------------------------------------------------------------- the layer

L_HIDDEN, L_FFN = 8, 12
UNEVEN_SHIFT = 1.0


def layer_tokens(group_rank: int, salt: int, dtype, uneven: bool) -> torch.Tensor:
    """[1, 5 + 2 r, H]: every group rank its own token count, none dividing E or N."""
    gen = torch.Generator().manual_seed(100 * salt + group_rank)
    x = torch.randn(1, 5 + 2 * group_rank, L_HIDDEN, generator=gen, dtype=torch.float64)
    return (x + (UNEVEN_SHIFT if uneven else 0.0)).to(dtype)


def skewed_gate(gate: torch.Tensor) -> torch.Tensor:
    """Uneven routing: expert 0's weights lifted along the all-ones direction, so that tokens
    shifted by +1 (``UNEVEN_SHIFT``) nearly all choose it first."""
    gate = gate.clone()
    gate[0] += (4.0 * gate.new_ones(gate.shape[1]) / math.sqrt(gate.shape[1])).to(gate.dtype)
    return gate


def layer_cases(m: int, world: bool) -> list:
    """(name, E, k, capacity factor, uneven, dtype) for a group of m ranks."""
    e = 2 * m if m > 1 else 4
    cases = [(f"k=2, dropless", e, 2, None, False, torch.float64),
             (f"k=1, capacity 1.0, uneven", e, 1, 1.0, True, torch.float64),
             (f"k=3, capacity 0.5 (drops)", e, 3, 0.5, False, torch.float64),
             (f"k=E={e}, capacity 1.0 (every expert exactly full)", e, e, 1.0, False, torch.float64),
             (f"k=2, capacity 1.25, uneven", e, 2, 1.25, True, torch.float32)]
    if world:
        cases += [(f"k=1, dropless, uneven", e, 1, None, True, torch.float64),
                  (f"k=2, capacity E/k = {e / 2:g} (no drop)", e, 2, e / 2, False, torch.bfloat16),
                  (f"k=1, dropless", e, 1, None, False, torch.float16)]
    if world and m > 1:
        cases += [(f"k={min(3, m)}, dropless, one expert per rank", m, min(3, m), None, False, torch.float32)]
    return cases


def reference_routing(xs, gate, k, factor, num_experts):
    """Per group rank: (kept experts, all experts) under the reference rules."""
    from labkit.moe import expert_capacity, keep_mask, route
    out = []
    for x in xs:
        tokens = x.reshape(-1, x.shape[-1])
        experts = route(tokens, gate, k)[0]
        kept = experts[keep_mask(experts, num_experts, expert_capacity(tokens.shape[0], num_experts, k, factor))]
        out.append((kept, experts))
    return out


def layer_on_rank() -> None:
    from labkit.moe import ExpertParallelMoE, init_experts, reference_moe
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = groups_of_world()
    with CommTracer() as tracer:  # bad input: a clear error before any communication
        for kwargs in [dict(num_experts=4, k=5), dict(num_experts=4, k=0), dict(num_experts=4, capacity_factor=0.0),
                       dict(num_experts=4, capacity_factor=-1.0)] + ([dict(num_experts=2 * n + 1)] if n > 1 else []):
            with pytest.raises(ValueError):
                ExpertParallelMoE(L_HIDDEN, L_FFN, **kwargs)
        for _, members, group in groups[1:]:
            if rank in members:
                with pytest.raises(ValueError):
                    ExpertParallelMoE(L_HIDDEN, L_FFN, len(members) + 1, k=1, group=group)
    assert not tracer.events, f"moe.layer: bad input must fail before any communication, traced {tracer.ops()}"
    salt = 0
    for group_name, members, group in groups:
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        for name, num_experts, k, factor, uneven, dtype in layer_cases(m, group is None):
            salt += 1
            local = num_experts // m
            what = f"moe.layer: rank {rank}, {group_name}, E={num_experts}, {name}, {NAMES[dtype]}"
            layer = ExpertParallelMoE(L_HIDDEN, L_FFN, num_experts, k, factor, group=group, seed=salt, dtype=dtype)
            gate, w1, w2 = init_experts(num_experts, L_HIDDEN, L_FFN, salt, dtype)
            if uneven:
                gate = skewed_gate(gate)
                with torch.no_grad():
                    layer.gate.copy_(gate)
            for p, name_p in ((layer.gate, "gate"), (layer.w1, "w1"), (layer.w2, "w2")):
                assert p.dtype == dtype, f"{what}: {name_p} must be {dtype}, got {p.dtype}"
            xs = [layer_tokens(r, salt, dtype, uneven).requires_grad_(True) for r in range(m)]
            ref = [p.clone().requires_grad_(True) for p in (gate, w1, w2)]
            (ref_y, ref_aux, ref_z), ref_grads, terms = reference_over_ranks(
                lambda x, *p: reference_moe(x, *p, k, factor), xs, ref,
                lambda r, y, aux, z: y.double().pow(2).sum() + aux.double() + z.double(), me)
            x = xs[me].detach().clone().requires_grad_(True)
            with CommTracer() as tracer:
                y, aux = layer(x)
                (y.double().pow(2).sum() + aux.double() + layer.z_loss.double()).backward()
            near(y, ref_y, what + ": output vs one process holding every expert")
            near(aux, ref_aux, what + ": load-balancing loss")
            near(layer.z_loss, ref_z, what + ": z-loss")
            near(x.grad, xs[me].grad, what + ": input gradient (through combine, experts and dispatch)")
            mine = slice(me * local, (me + 1) * local)
            near(layer.w1.grad, ref_grads[1][mine], what + ": w1 gradient of my experts (tokens of every group rank)", terms[1][mine])
            near(layer.w2.grad, ref_grads[2][mine], what + ": w2 gradient of my experts (tokens of every group rank)", terms[2][mine])
            gate_grad = layer.gate.grad.clone()
            dist.all_reduce(gate_grad, group=group)
            near(gate_grad, ref_grads[0], what + ": gate gradient summed over the group", terms[0])
            routing = reference_routing([t.detach() for t in xs], gate, k, factor, num_experts)
            sent = routing[me][0].numel()
            received = sum(((kept // local) == me).sum().item() for kept, _ in routing)
            assert tuple(layer.routed_rows) == (sent, received), \
                f"{what}: routed_rows must be (rows sent, rows received) = {(sent, received)}, got {layer.routed_rows}"
            row = max(sent, received) * L_HIDDEN * torch.tensor([], dtype=dtype).element_size()
            assert_sequence(tracer, [Op("all_to_all", num_experts * 8, members)] + 4 * [Op("all_to_all", row, members)],
                            what + f" (in group {members}: counts E x 8 B first; then dispatch, combine, and both "
                                   f"in backward: max({sent} sent, {received} received) rows x H x element size)")
            assert [e.dtype for e in tracer.events] == [torch.int64] + 4 * [dtype], \
                f"{what}: counts as int64, rows as {dtype}: traced {[e.dtype for e in tracer.events]}"
            # the case is what it says
            kept_all = torch.cat([kept for kept, _ in routing])
            choices = sum(ex.numel() for _, ex in routing)
            loads = torch.bincount(kept_all, minlength=num_experts)
            if uneven and k == 1:
                assert (loads == 0).any(), f"test set-up ({what}): some expert should get no token, loads {loads.tolist()}"
            if factor is not None and "no drop" not in name and "exactly" not in name:
                assert kept_all.numel() < choices, f"test set-up ({what}): capacity should drop some choices"
            elif factor is not None:
                assert kept_all.numel() == choices, f"test set-up ({what}): capacity should drop nothing"
            if k == 1:  # Switch: the router learns from the task loss
                x2 = xs[me].detach().clone()
                layer.zero_grad()
                y, _ = layer(x2)
                y.double().pow(2).sum().backward()
                ref_gate = gate.clone().requires_grad_(True)
                task = sum(reference_moe(t.detach(), ref_gate, w1, w2, k, factor)[0].double().pow(2).sum() for t in xs)
                task.backward()
                gate_grad = layer.gate.grad.clone()
                dist.all_reduce(gate_grad, group=group)
                assert gate_grad.abs().max() > 0, f"{what}: at k = 1 the router must get a gradient from the task loss"
                near(gate_grad, ref_gate.grad, what + ": gate gradient of the task loss alone (k = 1, Switch)")
    for group_name, members, group in groups[:1] + groups[1:][-1:]:  # several steps: the world and the last subgroup
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        for name, k, factor, make_opt in [
                ("AdamW, k=2, capacity 1.5", 2, 1.5, lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
                ("momentum SGD, k=1, dropless, frozen gate", 1, None,
                 lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9))]:
            num_experts, local = 2 * m, 2
            what = f"moe.layer: rank {rank}, {group_name}, {name}"
            layer = ExpertParallelMoE(L_HIDDEN, L_FFN, num_experts, k, factor, group=group, seed=9, dtype=torch.float64)
            ref = [p.clone().requires_grad_(True) for p in init_experts(num_experts, L_HIDDEN, L_FFN, 9, torch.float64)]
            frozen = "frozen" in name
            if frozen:
                layer.gate.requires_grad_(False)
                ref[0].requires_grad_(False)
            opt = make_opt([p for p in layer.parameters() if p.requires_grad])
            ref_opt = make_opt([p for p in ref if p.requires_grad])
            for step in range(3):
                xs = [layer_tokens(r, 40 + step, torch.float64, False) for r in range(m)]
                y, aux = layer(xs[me])
                loss = y.pow(2).mean() + 0.01 * aux
                opt.zero_grad()
                loss.backward()
                if not frozen:
                    dist.all_reduce(layer.gate.grad, group=group)  # replicated: summed like the reference's
                opt.step()
                ref_losses = [reference_moe(x, *ref, k, factor) for x in xs]
                ref_loss = sum(y.pow(2).mean() + 0.01 * a for y, a, _ in ref_losses)
                ref_opt.zero_grad()
                ref_loss.backward()
                ref_opt.step()
                total = loss.detach().clone()
                dist.all_reduce(total, group=group)
                near(total, ref_loss.detach(), f"{what}, step {step + 1}: loss summed over the group")
                near(layer.w1, ref[1][me * local:(me + 1) * local], f"{what}, after step {step + 1}: my w1")
                near(layer.w2, ref[2][me * local:(me + 1) * local], f"{what}, after step {step + 1}: my w2")
                near(layer.gate, ref[0], f"{what}, after step {step + 1}: gate")


# ----------------------------------------------------------------------------- the layer, drawn configurations

LONG = configs.LONG  # a developer's long mode: many more drawn configurations


def drawn_layer_case(draw: random.Random, m: int) -> dict:
    """One configuration of ``ExpertParallelMoE`` from its documented space, for a group of m:
    E/N experts per rank (1-3), any k from 1 to E, dropless or a capacity factor in (0, 2.5],
    any of the four dtypes, H and F from 1 to 9, each rank its own [B, T, H] input (B 1-3,
    T 1-6), routing even or skewed."""
    local = draw.randint(1, 3)
    num_experts = m * local if m > 1 else draw.randint(1, 5)
    return dict(num_experts=num_experts, k=draw.randint(1, num_experts),
                factor=None if draw.random() < 0.35 else round(draw.uniform(0.05, 2.5), 2),
                dtype=draw.choice(DTYPES), hidden=draw.randint(1, 9), ffn=draw.randint(1, 9),
                shapes=[(draw.randint(1, 3), draw.randint(1, 6)) for _ in range(m)],
                again=[(draw.randint(1, 3), draw.randint(1, 6)) for _ in range(m)],
                uneven=draw.random() < 0.3, salt=draw.randrange(2 ** 31))


def layer_drawn_on_rank(seed: int, cases: int) -> None:
    """``ExpertParallelMoE`` on configurations drawn from its whole documented space (a new seed
    each run), on the world and, at N = 3, the pair {0, 1}: forward and backward with a random
    incoming gradient for y and random weights on aux and z-loss, against ``reference_moe``
    (output, aux, z, input, expert and gate gradients); then the same layer called again on
    inputs of other shapes (nothing cached from the first call)."""
    from labkit.moe import ExpertParallelMoE, init_experts, reference_moe
    rank = dist.get_rank()
    groups = groups_of_world()[:2]
    for case in range(cases):
        draw = random.Random(seed * 1_000_003 + case)  # the same draws on every rank
        group_name, members, group = groups[draw.randrange(len(groups))]
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        c = drawn_layer_case(draw, m)
        num_experts, k, factor, dtype, hidden, ffn = (c[key] for key in ("num_experts", "k", "factor", "dtype", "hidden", "ffn"))
        local = num_experts // m
        what = (f"moe.layer (drawn case {case}, LABKIT_SEED={seed}): rank {rank}, {group_name}, E={num_experts}, k={k}, "
                f"capacity factor {factor}, {NAMES[dtype]}, H={hidden}, F={ffn}, inputs {c['shapes']}"
                f"{', skewed routing' if c['uneven'] else ''}")
        layer = ExpertParallelMoE(hidden, ffn, num_experts, k, factor, group=group, seed=c["salt"] % 997, dtype=dtype)
        gate, w1, w2 = init_experts(num_experts, hidden, ffn, c["salt"] % 997, dtype)
        if c["uneven"]:
            gate = skewed_gate(gate)
            with torch.no_grad():
                layer.gate.copy_(gate)
        for call, shapes in (("first call", c["shapes"]), ("second call, other shapes", c["again"])):
            gen = torch.Generator().manual_seed(c["salt"] + (call != "first call"))
            xs = [(torch.randn(b, t, hidden, generator=gen, dtype=torch.float64)
                   + (UNEVEN_SHIFT if c["uneven"] else 0.0)).to(dtype).requires_grad_(True) for b, t in shapes]
            gs = [torch.randn(b, t, hidden, generator=gen, dtype=torch.float64).to(dtype) for b, t in shapes]
            a_aux, a_z = (torch.rand((), generator=gen, dtype=torch.float64).item() for _ in range(2))
            where = f"{what}, {call} on inputs {shapes}"
            ref = [p.clone().requires_grad_(True) for p in (gate, w1, w2)]
            (ref_y, ref_aux, ref_z), ref_grads, terms = reference_over_ranks(
                lambda x, *p: reference_moe(x, *p, k, factor), xs, ref,
                lambda r, y, aux, z: (y * gs[r]).sum().double() + a_aux * aux.double() + a_z * z.double(), me)
            layer.zero_grad()
            x = xs[me].detach().clone().requires_grad_(True)
            y, aux = layer(x)
            assert y.shape == x.shape and y.dtype == dtype, f"{where}: y must be {dtype} {tuple(x.shape)}, got {y.dtype} {tuple(y.shape)}"
            torch.autograd.backward([y, aux, layer.z_loss], [gs[me], torch.tensor(a_aux, dtype=aux.dtype),
                                                             torch.tensor(a_z, dtype=layer.z_loss.dtype)])
            near(y, ref_y, where + ": output vs one process holding every expert")
            near(aux, ref_aux, where + ": load-balancing loss")
            near(layer.z_loss, ref_z, where + ": z-loss")
            near(x.grad, xs[me].grad, where + ": input gradient for a random incoming gradient")
            mine = slice(me * local, (me + 1) * local)
            near(layer.w1.grad, ref_grads[1][mine], where + ": w1 gradient of my experts", terms[1][mine])
            near(layer.w2.grad, ref_grads[2][mine], where + ": w2 gradient of my experts", terms[2][mine])
            gate_grad = layer.gate.grad.clone()
            dist.all_reduce(gate_grad, group=group)
            near(gate_grad, ref_grads[0], where + ": gate gradient summed over the group", terms[0])


# ----------------------------------------------------------------------------- EP x DP

GPT_MOE = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)
GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 3: [(3, 1), (1, 3)], 4: [(2, 2), (4, 1), (1, 4)]}  # (ep, dp)
PER_RANK, STEPS, LR = 2, 3, 1e-2
GPT_CASES = [  # name, k, capacity factor, uneven, optimizer, frozen + unused parameters
    ("k=2, dropless, AdamW", 2, None, False, "adamw", False),
    ("k=1, capacity 1.0, uneven, momentum SGD, frozen wpe + an unused parameter", 1, 1.0, True, "sgd", True),
    ("k=3, capacity 1.0, AdamW", 3, 1.0, False, "adamw", False),
]


def make_optimizer(kind, params):
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR) if kind == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


@torch.no_grad()
def skew_towards_expert_0(gpt) -> None:
    """Uneven routing in every MoE layer: LayerNorm outputs have zero mean over features, so a
    constant ln_2 bias is a direction every token shares; lifting expert 0's gate along it
    raises its logit for all tokens (by 0.5 * 2 * sqrt(H), about 2.8 at H = 8)."""
    for block in gpt.blocks:
        block.ln_2.bias.fill_(0.5)
        block.mlp.gate[0] += 2.0 / math.sqrt(block.mlp.gate.shape[1])


def ep_dp_on_rank(drawn: list[dict]) -> None:
    from labkit.models import GPT, GPTConfig
    from labkit.moe import ep_dp_grid, expert_parallel_gpt, EP_AXIS
    n = dist.get_world_size()
    with CommTracer() as tracer:  # bad input: a clear error before any communication
        for ep, dp in [(n, 2), (n + 1, 1), (0, n)]:
            with pytest.raises(ValueError):
                ep_dp_grid(n, ep, dp)
    assert not tracer.events, f"moe.ep_dp: bad grids must fail before any communication, traced {tracer.ops()}"
    for index, (ep, dp) in enumerate(GRIDS[n]):
        grid = ep_dp_grid(n, ep, dp)
        experts_total = 2 * ep if ep == 3 else 4
        with CommTracer() as tracer:  # a model whose experts do not split: refused before any communication
            for bad in ([dict(GPT_MOE, n_experts=2 * ep + 1)] if ep > 1 else []) + [dict(GPT_MOE, n_experts=0)]:
                with pytest.raises(ValueError):
                    expert_parallel_gpt(GPT(GPTConfig(**bad)), grid.group(EP_AXIS))
        assert not tracer.events, f"moe.ep_dp: bad models must fail before any communication, traced {tracer.ops()}"
        # every case on the first grid, one each (in turn) on the others: the test time stays small
        for case in (GPT_CASES if index == 0 else [GPT_CASES[index % 3]]):
            train_ep_dp(grid, ep, case, experts_total)
    for case in drawn:
        train_ep_dp(ep_dp_grid(n, *case["grid"]), case["grid"][0], case["case"], case["experts"], case["seed"],
                    case["scale"], case["label"])


def draw_ep_dp(n: int) -> list[dict]:
    """Drawn cases for one launch at world size n (a new seed each run): any grid of n, E/ep 1-3
    experts per rank, k from 1 to min(E, 3), dropless or a capacity factor in [0.5, 2], even or
    skewed routing, AdamW or momentum SGD, a frozen and an unused parameter or not, other
    weights and data, a loss scaled by a factor in [0.25, 4]."""
    rng = configs.rng(f"moe.ep_dp:{n}")
    cases = []
    for i in range(configs.budget(ci=1, long=8)):
        ep, dp = rng.choice(GRIDS[n])
        experts = ep * rng.randint(1, 3)
        k = rng.randint(1, min(experts, 3))
        factor = None if rng.random() < 0.4 else round(rng.uniform(0.5, 2.0), 2)
        uneven, optimizer, frozen = rng.random() < 0.4, rng.choice(("adamw", "sgd")), rng.random() < 0.5
        name = (f"drawn: k={k}, {'dropless' if factor is None else f'capacity {factor}'}"
                f"{', uneven' if uneven else ''}, {optimizer}{', frozen wpe + an unused parameter' if frozen else ''}")
        cases.append(dict(grid=(ep, dp), experts=experts, case=(name, k, factor, uneven, optimizer, frozen),
                          seed=rng.randrange(10 ** 6), scale=round(rng.uniform(0.25, 4.0), 3),
                          label=f"case {i} {configs.replay(f'moe.ep_dp, world size {n}')}"))
    return cases


def train_ep_dp(grid, ep: int, case: tuple, experts_total: int, seed: int = 3, scale: float = 1.0,
                drawn: str = "") -> None:
    """STEPS steps of a 2-layer MoE GPT with the learner's EP layer on ``grid`` (ep x dp), against
    one process holding every expert; ``drawn``: the label of a drawn case (its set-up is not
    checked to be what a fixed case's name says)."""
    from labkit.models import GPT, GPTConfig
    from labkit.moe import average_ep_dp_gradients, expert_parallel_gpt, expert_parameters, EP_AXIS
    rank, n = dist.get_rank(), dist.get_world_size()
    dp = n // ep
    ep_members = list(range(rank // ep * ep, rank // ep * ep + ep))   # consecutive ranks
    dp_members = list(range(rank % ep, n, ep))
    name, k, factor, uneven, optimizer, frozen = case
    what = f"moe.ep_dp: rank {rank} of {n}, ep={ep} x dp={dp}, E={experts_total}, {name}{', ' + drawn if drawn else ''}"
    config = GPTConfig(**GPT_MOE, n_experts=experts_total, moe_k=k, moe_capacity_factor=factor)
    ref = GPT(config, seed=seed).double()
    if uneven:
        skew_towards_expert_0(ref)
    if frozen:
        ref.wpe.weight.requires_grad_(False)
        ref.unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    model = expert_parallel_gpt(copy.deepcopy(ref), grid.group(EP_AXIS))
    opt, ref_opt = make_optimizer(optimizer, model.parameters()), make_optimizer(optimizer, ref.parameters())
    local = config.n_experts // ep
    mine = slice(rank % ep * local, (rank % ep + 1) * local)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + 17 + seed)
        data = torch.randint(0, config.vocab_size, (n * PER_RANK, config.block_size + 1), generator=gen)
        x, y = data[:, :-1], data[:, 1:]
        # the reference: every slice through one process holding every expert, losses averaged
        ref_opt.zero_grad()
        ref_loss, kept, chosen = 0, [], []
        for r in range(n):
            part = slice(r * PER_RANK, (r + 1) * PER_RANK)
            ref_loss = ref_loss + scale * ref(x[part], y[part])[1] / n
            kept.append([block.mlp.kept_experts for block in ref.blocks])
            chosen.append([block.mlp.experts for block in ref.blocks])
        ref_loss.backward()
        ref_opt.step()
        mine_part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        with CommTracer() as tracer:
            loss = scale * model(x[mine_part], y[mine_part])[1]
            opt.zero_grad()
            loss.backward()
            average_ep_dp_gradients(model, grid)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        near(total / n, ref_loss.detach(), f"{what}, step {step + 1}: global loss (mean over ranks)")
        if step == 0:
            forward, backward = [], []
            for layer in range(config.n_layer):
                sent = kept[rank][layer].numel()
                received = sum(((kept[r][layer] // local) == rank % ep).sum().item() for r in ep_members)
                rows = Op("all_to_all", max(sent, received) * config.n_embd * 8, ep_members)
                forward += [Op("all_to_all", config.n_experts * 8, ep_members), rows, rows]
                backward = [rows, rows] + backward
            experts = {id(p) for p in expert_parameters(model)}
            reduces = [Op("all_reduce", p.numel() * 8, dp_members if id(p) in experts else None)
                       for p in model.parameters() if p.grad is not None]
            assert_sequence(tracer, forward + backward + reduces,
                            what + " (per MoE layer: counts, dispatch, combine in the EP group, then both "
                                   "back, last layer first; one all-reduce per parameter with a gradient, "
                                   "in model.parameters() order: dense over the world, expert over the DP group)")
        ref_params = dict(ref.named_parameters())
        for pname, p in model.named_parameters():
            ref_p = ref_params[pname.replace("mlp.moe.", "mlp.")]
            expert = pname.endswith(("moe.w1", "moe.w2"))
            near(p, ref_p[mine] if expert else ref_p, f"{what}, after step {step + 1}: {pname}"
                 + (" (this rank's experts)" if expert else ""))
        if step == 0 and factor is not None and not drawn:  # the case is what it says: some choices dropped
            choices = sum(t.numel() for per_rank in kept for t in per_rank)
            assert choices < n * config.n_layer * PER_RANK * config.block_size * config.moe_k, \
                "test set-up: capacity 1.0 should drop some choices"
        if step == 0 and uneven and not drawn:  # ... and most tokens choose expert 0, in every layer
            share = [(t == 0).any(dim=1).float().mean().item() for per_rank in chosen for t in per_rank]
            assert min(share) > 0.75, f"test set-up: most tokens should choose expert 0, {share}"




# ----------------------------------------------------------------------------- bias balance

B_EXPERTS, B_GAMMA = 6, 0.01
B_LOADS = ([4, 4, 1, 7, 2, 6], [10, 0, 5, 5, 3, 7], [3, 3, 3, 3, 3, 3], [0, 12, 6, 6, 1, 11])  # group loads, ties with the mean


def bias_counts(step: int, member: int, m: int) -> torch.Tensor:
    """Member ``member`` of m's counts at ``step``: the members' counts sum to B_LOADS[step];
    member 0 gets what is left, the others a reversed share (their own sign pattern differs)."""
    load = torch.tensor(B_LOADS[step], dtype=torch.int64)
    others = [torch.div(load.flip(0) * (j + 1), 2 * m, rounding_mode="floor").minimum(load // m) for j in range(1, m)]
    share = [load - sum(others, torch.zeros_like(load))] + others
    return share[member]


def ref_bias_step(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    load = load.double()
    return (bias.double() + gamma * torch.sign(load.mean() - load)).float()


def bias_balance_on_rank(seed: int) -> None:
    from labkit.moe import BiasBalancer, route
    rank = dist.get_rank()
    # route with a bias: per rank, no communication
    for salt, (dtype, k) in enumerate((d, k) for d in DTYPES for k in (1, 2, 3)):
        what = f"moe.bias_balance: route(bias=...) on rank {rank}, {NAMES[dtype]}, k={k}, E={R_EXPERTS}, T={R_TOKENS}"
        gen = torch.Generator().manual_seed(5000 + 100 * rank + salt)
        x = torch.randn(R_TOKENS, R_HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
        gate = torch.randn(R_EXPERTS, R_HIDDEN, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
        bias = (torch.randn(R_EXPERTS, generator=gen, dtype=torch.float64) * 0.3).float().requires_grad_(True)
        x64, gate64 = x.double(), gate.detach().double()
        experts, weights, probs, logits = route(x, gate, k, bias=bias)
        for name, t in (("weights", weights), ("probs", probs), ("logits", logits)):
            assert isinstance(t, torch.Tensor) and t.dtype == dtype, \
                f"{what}: {name} must be {dtype} (the dtype of x), got {getattr(t, 'dtype', type(t))}"
        assert experts.dtype == torch.int64 and experts.shape == (R_TOKENS, k), \
            f"{what}: experts must be int64 [T, k], got {experts.dtype} {tuple(experts.shape)}"
        ref_logits = x64 @ gate64.t()
        near(logits, ref_logits.to(dtype), what + ": logits = x W^T")
        near(probs, ref_softmax(ref_logits).to(dtype), what + ": softmax probabilities (unbiased)")
        scores = probs.detach().float() + bias.detach()
        ordered = torch.sort(scores, dim=1, descending=True, stable=True)
        assert (ordered.values[:, k - 1] - ordered.values[:, k] > 1e-4).all(), "test set-up: no near tie at the k-th choice"
        want = ordered.indices[:, :k]
        unbiased = torch.sort(probs.detach().float(), dim=1, descending=True, stable=True).indices[:, :k]
        assert not torch.equal(want, unbiased), "test set-up: the bias should change some choices"
        assert torch.equal(experts, want), \
            f"{what}: experts must be the top-k of probs + bias (float32), highest first\n got {experts.tolist()}\n want {want.tolist()}"
        near(weights, ref_weights(gate64, x64, experts, k).to(dtype),
             what + (": k = 1 weight = the unbiased chosen probability" if k == 1 else
                     ": weights = the unbiased probabilities of the chosen, renormalised"))
        c = torch.randn(R_TOKENS, k, generator=gen, dtype=torch.float64)
        task_grad, bias_grad = torch.autograd.grad((weights * c.to(dtype)).sum(), (gate, bias), allow_unused=True)
        g = gate64.clone().requires_grad_(True)
        ref_task, = torch.autograd.grad((ref_weights(g, x64, experts, k) * c).sum(), g)
        near(task_grad, ref_task.to(dtype), what + ": gate gradient of sum(weights * c) (the bias enters no weight)")
        assert bias_grad is None or not bias_grad.any(), f"{what}: the bias must get no gradient, got {bias_grad}"
    for group_name, members, group in groups_of_world():
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        # update against a loop: the counts arrive through count(), the update is one all-reduce
        what = f"moe.bias_balance: BiasBalancer.count/update on rank {rank}, {group_name}, gamma={B_GAMMA}"
        balancer = BiasBalancer(B_EXPERTS, gamma=B_GAMMA, group=group)
        assert balancer.counts.dtype == torch.int64 and torch.equal(balancer.counts, torch.zeros(B_EXPERTS, dtype=torch.int64)), \
            f"{what}: counts must start as int64 zeros [E], got {balancer.counts}"
        ref, differ = torch.zeros(B_EXPERTS), 0
        for step in range(len(B_LOADS)):
            counts = bias_counts(step, me, m)
            local, glob = counts.double(), torch.tensor(B_LOADS[step], dtype=torch.float64)
            differ += not torch.equal(torch.sign(local.mean() - local), torch.sign(glob.mean() - glob))
            # this rank's choices as two [T, k] routings (k = 1 and k = 2), shuffled: counts add up
            chosen = torch.repeat_interleave(torch.arange(B_EXPERTS), counts)
            chosen = chosen[torch.randperm(chosen.numel(), generator=torch.Generator().manual_seed(step))]
            half = chosen.numel() // 4 * 2  # an even share as [T, 2], the rest as [T, 1]
            where = f"{what}, step {step + 1}, group load {B_LOADS[step]}, my counts {counts.tolist()}"
            with CommTracer() as tracer:
                balancer.count(chosen[:half].reshape(-1, 2))
                balancer.count(chosen[half:].reshape(-1, 1))
            assert_ops(tracer, [], where + ": count communicates nothing")
            assert torch.equal(balancer.counts, counts), \
                f"{where}: counts after count() of this rank's choices: got {balancer.counts.tolist()}, want {counts.tolist()}"
            ref = check_update(balancer, ref, torch.tensor(B_LOADS[step]), B_GAMMA, members, where)
            every = [torch.empty_like(balancer.bias) for _ in members]
            dist.all_gather(every, balancer.bias.clone(), group=group)
            assert all(torch.equal(b, balancer.bias) for b in every), f"{where}: the bias differs between ranks of the group"
        assert m == 1 or differ >= 2, f"test set-up: rank {rank}'s own counts should differ in sign from the group's, {differ} steps"
        for k in (1, 2, 3):
            balancer_steps(balancer_cls=BiasBalancer, group=group, members=members, me=me, k=k,
                           what=f"moe.bias_balance: BiasBalancer.route on rank {rank}, {group_name}, k={k}")
    bias_balance_drawn(seed)


def check_update(balancer, ref: torch.Tensor, load: torch.Tensor, gamma: float, members: list, where: str):
    """``balancer.update()`` against the loop on the group's ``load``: the bias (float32 [E], the
    same tensor, moved by gamma sign(mean - load)), the counts zeroed, one all-reduce of the E
    int64 counts in the group. Returns the loop's new bias."""
    experts = load.numel()
    with CommTracer() as tracer:
        got = balancer.update()
    ref = ref_bias_step(ref, load, gamma)
    assert got is balancer.bias, f"{where}: update must return self.bias (updated in place)"
    assert balancer.bias.dtype == torch.float32 and balancer.bias.shape == (experts,), \
        f"{where}: bias must be float32 [E], got {balancer.bias.dtype} {tuple(balancer.bias.shape)}"
    assert_close(balancer.bias, ref, where + ": bias += gamma sign(mean load - load), load summed over the group",
                 rtol=0, atol=1e-6)
    assert torch.equal(balancer.counts, torch.zeros(experts, dtype=torch.int64)), \
        f"{where}: update must zero the counts for the next step, got {balancer.counts.tolist()}"
    assert_sequence(tracer, [Op("all_reduce", experts * 8, members)],
                    where + f" (one all-reduce of the E int64 counts in group {members})")
    return ref


def bias_balance_drawn(seed: int) -> None:
    """Drawn configurations of BiasBalancer.count/update, the same on every rank (one stream
    from the test process's seed): E 2-12, gamma from 1e-4 to 0.5, 2-4 steps, each rank's
    counts drawn per step (zeros and idle experts included) and handed to count() as [T, k]
    routings of drawn k (an empty one included), in every group of the world's layouts;
    against the loop on the group-summed loads, with the one all-reduce traced."""
    from labkit.moe import BiasBalancer
    rank, n = dist.get_rank(), dist.get_world_size()
    rng = configs.stream(seed, "moe.bias_balance")
    groups = groups_of_world()
    for case in range(configs.budget(ci=3, long=30)):
        experts, steps = rng.randint(2, 12), rng.randint(2, 4)
        gamma = rng.choice((10 ** rng.uniform(-4, -1), 0.5))
        counts = [[[0 if rng.random() < 0.2 else rng.randint(0, 9) for _ in range(experts)] for _ in range(n)]
                  for _ in range(steps)]   # [step][global rank][expert]
        ks = [[rng.choice((1, 2, 3)) for _ in range(3)] for _ in range(steps)]
        for group_name, members, group in groups:
            if rank not in members:
                continue
            what = (f"moe.bias_balance: BiasBalancer.count/update on rank {rank}, {group_name}, drawn case {case} "
                    f"(E={experts}, gamma={gamma:.3g}) {configs.replay(f'moe.bias_balance, world size {n}')}")
            balancer = BiasBalancer(experts, gamma=gamma, group=group)
            ref = torch.zeros(experts)
            for step in range(steps):
                mine = torch.tensor(counts[step][rank], dtype=torch.int64)
                load = torch.tensor([sum(counts[step][r][e] for r in members) for e in range(experts)])
                chosen = torch.repeat_interleave(torch.arange(experts), mine)
                chosen = chosen[torch.randperm(chosen.numel(), generator=torch.Generator().manual_seed(step))]
                where = f"{what}, step {step + 1}, group load {load.tolist()}, my counts {mine.tolist()}"
                start = 0
                with CommTracer() as tracer:
                    for k in ks[step]:   # routings of k choices per token; the rest as k = 1
                        take = (chosen.numel() - start) // 2 // k * k
                        balancer.count(chosen[start:start + take].reshape(-1, k))
                        start += take
                    balancer.count(chosen[start:].reshape(-1, 1))
                assert_ops(tracer, [], where + ": count communicates nothing")
                assert torch.equal(balancer.counts, mine), \
                    f"{where}: counts after count() of routings with k in {ks[step]}: got {balancer.counts.tolist()}"
                ref = check_update(balancer, ref, load, gamma, members, where)


MICRO_TOKENS = (13, 7, 10)  # tokens of each micro-batch of a step: different lengths


class Recomputed(torch.autograd.Function):
    """Reentrant activation recomputation, as ``torch.utils.checkpoint(use_reentrant=True)`` and
    Megatron-Core's ``CheckpointFunction`` do it (written out here: tests set up torch's built-ins
    only through labkit.oracles): ``fn(*args)`` runs under no_grad in forward and again, recording,
    in backward."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad):
        args = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*args)
        torch.autograd.backward(out, grad)
        return (None,) + tuple(a.grad if a.requires_grad else None for a in args)


def clear_tokens(t: int, gate64, bias, k: int, seed: int) -> torch.Tensor:
    """t tokens [t, H] float64 whose k-th and (k+1)-th biased scores are at least 1e-4 apart
    (drawn, near ties dropped): a float32 rounding cannot swap a choice."""
    pool = 0.5 * torch.randn(8 * t, R_HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    scores = torch.sort(ref_softmax(pool @ gate64.t()).float() + bias, dim=1, descending=True).values
    clear = pool[scores[:, k - 1] - scores[:, k] > 1e-4]
    assert clear.shape[0] >= t, "test set-up: too few tokens without a near tie"
    return clear[:t]


def balancer_steps(balancer_cls, group, members, me, k, what) -> None:
    """``BiasBalancer.route`` in a training loop as DeepSeek-V3 and Megatron-Core run it: per
    step three micro-batches of different lengths, the first through a reentrant checkpoint
    (its routing recomputed in backward), the others plain, a loss scaled by a random incoming
    gradient, and an evaluation routing under no_grad; ``update()`` after the last backward.
    Against a float64 loop: every routing of the step (forward, recompute, evaluation) chooses
    with the bias of the earlier steps; the gate's gradient is the reference's (the recompute
    chose the forward's experts); ``counts`` before the update hold each micro-batch's choices
    once (the recompute and the evaluation not again); nothing is communicated until the
    update, which is one all-reduce of E int64s in the group."""
    m = len(members)
    balancer = balancer_cls(B_EXPERTS, gamma=0.05, group=group)
    gen = torch.Generator().manual_seed(7000 + k)
    gate64 = torch.randn(B_EXPERTS, R_HIDDEN, generator=gen, dtype=torch.float64)
    gate64[0] += 1.5 / math.sqrt(R_HIDDEN)  # mildly skewed towards expert 0 (no probability rounds away next to the bias)
    gate = gate64.clone().requires_grad_(True)
    ref, changed = torch.zeros(B_EXPERTS), False
    for step in range(4):
        where = f"{what}, step {step + 1}"
        xs = [[clear_tokens(t, gate64, ref, k, seed=1000 * step + 10 * j + i) for i, t in enumerate(MICRO_TOKENS)]
              for j in range(m)]
        picks = []
        for j in range(m):  # the reference's choices: every micro-batch with the bias of the earlier steps
            mine = []
            for x in xs[j]:
                p = ref_softmax(x @ gate64.t())
                biased = torch.sort(p.float() + ref, dim=1, descending=True, stable=True)
                assert (biased.values[:, k - 1] - biased.values[:, k] > 1e-5).all(), "test set-up: no near tie at the k-th choice"
                mine.append(biased.indices[:, :k])
                changed |= not torch.equal(mine[-1], p.argsort(dim=1, descending=True, stable=True)[:, :k])
            picks.append(mine)
        gate.grad = None
        ref_grad = torch.zeros_like(gate64)
        seen = []

        def routed(x, g):
            experts, weights, _, _ = balancer.route(x, g, k)
            seen.append(experts.clone())
            return weights

        with CommTracer() as tracer:
            for i, x in enumerate(xs[me]):
                c = torch.randn(x.shape[0], k, generator=torch.Generator().manual_seed(50 + i), dtype=torch.float64)
                scale = 0.5 + i  # a loss scaled before backward
                x = x.clone().requires_grad_(True)
                weights = Recomputed.apply(routed, x, gate) if i == 0 else routed(x, gate)
                ((weights * c).sum() * scale).backward()
                g = gate64.clone().requires_grad_(True)
                ref_grad += torch.autograd.grad((ref_weights(g, xs[me][i], picks[me][i], k) * c).sum() * scale, g)[0]
            with torch.no_grad():  # an evaluation forward: routes with the same bias, counts nothing
                experts, _, _, _ = balancer.route(xs[me][1], gate, k)
                seen.append(experts)
        # forward of micro-batch 1 (under no_grad), its recompute in its backward, 2, 3, the evaluation of 2
        want = [picks[me][0], picks[me][0], picks[me][1], picks[me][2], picks[me][1]]
        names = ["micro-batch 1 (checkpointed forward)", "micro-batch 1's recompute in backward", "micro-batch 2",
                 "micro-batch 3", "an evaluation routing of micro-batch 2 under no_grad"]
        assert len(seen) == len(want), f"{where}: {len(seen)} routings seen, want {len(want)}"
        for got, exp, name in zip(seen, want, names):
            assert torch.equal(got, exp), (f"{where}, {name}: experts must be chosen with the bias of the earlier steps "
                                           f"(the bias changes only in update())\n got {got.tolist()}\n want {exp.tolist()}")
        near(gate.grad, ref_grad, where + ": gate gradient over the micro-batches (the recompute must route as the forward)")
        assert_ops(tracer, [], where + ": routing and backward communicate nothing (the update comes after the step)")
        mine = sum(torch.bincount(t.reshape(-1), minlength=B_EXPERTS) for t in picks[me])
        assert torch.equal(balancer.counts, mine), (
            f"{where}: counts before the update must hold each micro-batch's choices once (not the recompute's, not "
            f"the evaluation's): got {balancer.counts.tolist()}, want {mine.tolist()}")
        with CommTracer() as tracer:
            balancer.update()
        assert_sequence(tracer, [Op("all_reduce", B_EXPERTS * 8, members)], where + ": update is one all-reduce of E int64s")
        load = sum(torch.bincount(t.reshape(-1), minlength=B_EXPERTS) for mine in picks for t in mine)
        ref = ref_bias_step(ref, load, 0.05)
        assert_close(balancer.bias, ref, where + f": bias after the update with the group's load {load.tolist()} "
                     "(every micro-batch of every rank)", rtol=0, atol=1e-6)
    assert changed, "test set-up: the bias should change some choices"


# ----------------------------------------------------------------------------- shared experts, overlapped

S_FFN = 10  # the shared experts' width: S F_s = 10 or 20, a dimension no other tensor of the layer has
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"})
ROW_A2AS = ("dispatch", "combine", "combine's reverse (backward)", "dispatch's reverse (backward)")


class SharedTracer(ConfinedTracer):
    """A ``ConfinedTracer`` that names the shared experts' matmuls on the timeline ("shared:mm"):
    a matmul one of whose tensors (inputs or output) has a shared width (F_s or S F_s) as a
    dimension and none the routed experts' width F. Measured from the shapes the ops run on,
    not from anything the layer reports."""

    def __init__(self, members, what: str, widths):
        super().__init__(members, what)
        self.widths = set(widths)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.timeline)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.timeline) > before and self.timeline[-1].what == "compute" and self.timeline[-1].op in MATMULS:
            dims = {d for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor) for d in t.shape}
            if dims & self.widths and L_FFN not in dims:
                step = self.timeline[-1]
                self.timeline[-1] = Step("compute", "shared:" + step.op, step.time)
        return out


def check_shared_overlap(tracer: SharedTracer, what: str) -> None:
    """Events 1-4 (the trace is checked before) are the row all-to-alls: each must have a
    shared-expert matmul between its post and its wait, and every shared-expert matmul must run
    while one of them is in flight (none before the dispatch is posted, after a wait, ...)."""
    shared_only = SimpleNamespace(events=tracer.events, timeline=[
        s for s in tracer.timeline if s.what != "compute" or s.op.startswith("shared:")])
    for index, name in zip(range(1, 5), ROW_A2AS):
        assert_overlap(shared_only, f"{what}: the {name} all-to-all (event {index}) must be in flight while "
                                    f"shared-expert matmuls run", events=[index])
    post = {s.event: i for i, s in enumerate(tracer.timeline) if s.what == "post"}
    wait = {}
    for i, s in enumerate(tracer.timeline):
        if s.what == "wait":
            wait.setdefault(s.event, i)
    windows = [(post[e], wait[e]) for e in range(1, 5)]
    shared = [i for i, s in enumerate(tracer.timeline) if s.what == "compute" and s.op.startswith("shared:")]
    outside = [i for i in shared if not any(a < i < b for a, b in windows)]
    if outside:
        def after(i):
            last = [s for s in tracer.timeline[:i] if s.what != "compute"]
            return (f"after the {last[-1].what} of event {last[-1].event} ({ROW_A2AS[last[-1].event - 1]})"
                    if last and last[-1].event else "before the dispatch was posted")
        where = "; ".join(f"{tracer.timeline[i].op} {after(i)}" for i in outside[:4])
        raise AssertionError(f"{what}: {len(outside)} of the {len(shared)} shared-expert matmuls ran while no "
                             f"all-to-all was in flight ({where}): post the all-to-all, run the shared experts, "
                             f"then wait")


def shared_cases(m: int, world: bool) -> list:
    """(name, E, k, capacity factor, uneven, dtype, S) for a group of m ranks."""
    e = 2 * m if m > 1 else 4
    cases = [("k=2, dropless, 1 shared", e, 2, None, False, torch.float64, 1),
             ("k=1, capacity 1.0, uneven, 2 shared", e, 1, 1.0, True, torch.float64, 2),
             ("k=3, capacity 0.5 (drops), 2 shared", e, 3, 0.5, False, torch.float32, 2)]
    if world:
        cases += [("k=2, capacity 1.25, 1 shared", e, 2, 1.25, False, torch.bfloat16, 1),
                  ("k=1, dropless, uneven, 2 shared", e, 1, None, True, torch.float16, 2)]
    return cases


def shared_reference(x, gate, w1, w2, sw1, sw2, k, factor):
    """One process: the routed reference plus each shared expert's MLP on every token, one by one."""
    from labkit.moe import expert_mlp, reference_moe
    y, aux, z = reference_moe(x, gate, w1, w2, k, factor)
    tokens = x.reshape(-1, x.shape[-1])
    shared = sum(expert_mlp(tokens, sw1[s], sw2[s]) for s in range(sw1.shape[0]))
    return y + shared.reshape(y.shape), aux, z


def fused(sw1, sw2):
    """[S, H, F_s], [S, F_s, H] -> the layer's [H, S F_s], [S F_s, H] (expert s in block s)."""
    return sw1.permute(1, 0, 2).reshape(sw1.shape[1], -1), sw2.reshape(-1, sw2.shape[2])


def overlap_function_on_rank(groups) -> None:
    """``AllToAllOverlap`` on its own: the rows exactly as ``AllToAll`` moves them (uneven splits, a
    non-contiguous input and a non-contiguous gradient), a side computation side(u, v, u) = u @ v + u
    whose first and third inputs are the same tensor (each must get the gradient of its own use)
    and whose second is frozen (None), its matmuls while the all-to-all is in flight both ways."""
    from labkit.moe import AllToAllOverlap
    rank = dist.get_rank()
    for group_name, members, group in groups:
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        for salt, (dtype, (pattern, rows_to)) in enumerate(zip(DTYPES, list(PATTERNS.items()) * 2)):
            send = [rows_to(me, d, m) for d in range(m)]
            recv = [rows_to(s, me, m) for s in range(m)]
            what = (f"moe.shared_overlap: AllToAllOverlap on rank {rank}, {group_name}, {NAMES[dtype]}, {pattern}: "
                    f"sends {send}, receives {recv}")
            base = torch.cat([torch.full((send[d], 2 * D_HIDDEN), 100.0 * me + d) for d in range(m)])
            base += torch.arange(2 * D_HIDDEN)
            x = base.to(dtype)[:, ::2].requires_grad_(True)  # non-contiguous
            gen = torch.Generator().manual_seed(900 + 10 * rank + salt)
            u = (torch.randn(S_FFN, S_FFN, generator=gen, dtype=torch.float64) / 3).to(dtype).requires_grad_(True)
            v = (torch.randn(S_FFN, S_FFN, generator=gen, dtype=torch.float64) / 3).to(dtype)
            c = (torch.randn(S_FFN, S_FFN, generator=gen, dtype=torch.float64) / 3).to(dtype)
            scale = torch.cat([torch.arange(1, sum(recv) + 1, dtype=dtype).unsqueeze(1).expand(-1, D_HIDDEN),
                               torch.zeros(sum(recv), D_HIDDEN, dtype=dtype)], dim=1)
            with SharedTracer(members, what, (S_FFN,)) as tracer:
                out, side = AllToAllOverlap.apply(x, recv, send, group, lambda a, b, d: a @ b + d, u, v, u)
                wide = torch.cat([out, torch.zeros_like(out)], dim=1)  # backward hands out a strided gradient
                ((wide * scale).sum() + (side * c).sum()).backward()
            want = torch.cat([torch.full((recv[s], 2 * D_HIDDEN), 100.0 * s + me) for s in range(m)])
            want = (want + torch.arange(2 * D_HIDDEN))[:, ::2].to(dtype)
            assert isinstance(out, torch.Tensor) and out.dtype == dtype, f"{what}: rows must be {dtype}"
            assert_close(out, want, what + ": the blocks received, in group-rank order", rtol=0, atol=0)
            grad = torch.cat([torch.arange(1, send[d] + 1, dtype=torch.float64) + sum(rows_to(s, d, m) for s in range(me))
                              for d in range(m)]).unsqueeze(1).expand(-1, D_HIDDEN).to(dtype)
            assert_close(x.grad, grad, what + ": backward sends each row's gradient back to its sender", rtol=0, atol=0)
            u64, v64, c64 = u.detach().double(), v.double(), c.double()
            near(side, (u64 @ v64 + u64).to(dtype), what + ": side output side(u, v, u) = u @ v + u")
            near(u.grad, (c64 @ v64.t() + c64).to(dtype),
                 what + ": gradient of u, used twice (c v^T through the matmul + c through the sum)")
            assert v.grad is None, f"{what}: v does not require grad: it must get none"
            size = D_HIDDEN * x.element_size()
            assert_sequence(tracer, 2 * [Op("all_to_all", max(sum(send), sum(recv)) * size, members)],
                            what + f" (one all-to-all forward, one back, in group {members}, "
                                   f"max(rows sent, received) x H x {x.element_size()} B; the side sends nothing)")
            assert [e.in_backward for e in tracer.events] == [False, True], \
                f"{what}: the second all-to-all must run in backward"
            shared_only = SimpleNamespace(events=tracer.events, timeline=[
                s for s in tracer.timeline if s.what != "compute" or s.op.startswith("shared:")])
            for index, name in enumerate(("forward", "backward (reverse)")):
                assert_overlap(shared_only, f"{what}: the {name} all-to-all must be in flight while the side's "
                                            f"matmuls run", events=[index])


def draw_shared(n: int) -> list:
    """``SharedExpertMoE`` configurations for one launch at world size n: a group of the world, E/N
    1-3, k 1-E, dropless or a capacity factor in (0, 2.5], the four dtypes, H and F 1-9, 1-3 shared
    experts of width 1-9 or the routed width (None), each rank's [B, T, H] input, twice (the second
    call of other shapes)."""
    rng = configs.rng(f"moe.shared_overlap:{n}")
    cases = []
    for i in range(configs.budget(ci=3, long=30)):
        local = rng.randint(1, 3)
        cases.append(dict(group=rng.randrange(GROUPS_AT[n]), local=local, k_draw=rng.random(),
                          factor=None if rng.random() < 0.4 else round(rng.uniform(0.05, 2.5), 2),
                          dtype=rng.choice(DTYPES), hidden=rng.randint(1, 9), ffn=rng.randint(1, 9),
                          num_shared=rng.randint(1, 3), shared_ffn=rng.choice((None, rng.randint(1, 9))),
                          shapes=[[(rng.randint(1, 3), rng.randint(1, 6)) for _ in range(4)] for _ in range(2)],
                          salt=rng.randrange(2 ** 31), replay=configs.replay(f"moe.shared_overlap, world size {n}, drawn case {i}")))
    return cases


def shared_drawn_on_rank(cases: list) -> None:
    """Each drawn case against ``shared_reference`` (one process): output, aux, z-loss, the input's
    gradient for a random incoming gradient (random weights on aux and z-loss), this rank's routed
    experts' gradients, the gate's and the shared experts' summed over the group; called twice."""
    from labkit.moe import SharedExpertMoE, init_experts, init_shared_experts
    rank = dist.get_rank()
    groups = groups_of_world()
    for c in cases:
        group_name, members, group = groups[c["group"]]
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        num_experts = m * c["local"]
        k = 1 + int(c["k_draw"] * num_experts)
        factor, dtype, hidden, ffn, shared, width = (c[key] for key in ("factor", "dtype", "hidden", "ffn", "num_shared", "shared_ffn"))
        seed = c["salt"] % 997
        what = (f"moe.shared_overlap (drawn): rank {rank}, {group_name}, E={num_experts}, k={k}, capacity factor {factor}, "
                f"{NAMES[dtype]}, H={hidden}, F={ffn}, {shared} shared of width {width} {c['replay']}")
        layer = SharedExpertMoE(hidden, ffn, num_experts, k, factor, group=group, seed=seed, dtype=dtype,
                                num_shared=shared, shared_ffn=width)
        params = init_experts(num_experts, hidden, ffn, seed, dtype) + init_shared_experts(shared, hidden, width or ffn, seed, dtype)
        for call, shapes in enumerate(c["shapes"]):
            shapes = shapes[:m]
            gen = torch.Generator().manual_seed(c["salt"] + call)
            xs = [torch.randn(b, t, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True) for b, t in shapes]
            gs = [torch.randn(b, t, hidden, generator=gen, dtype=torch.float64).to(dtype) for b, t in shapes]
            a_aux, a_z = (torch.rand((), generator=gen, dtype=torch.float64).item() for _ in range(2))
            where = f"{what}, call {call + 1} on inputs {shapes}"
            ref = [p.clone().requires_grad_(True) for p in params]
            (ref_y, ref_aux, ref_z), ref_grads, terms = reference_over_ranks(
                lambda x, *p: shared_reference(x, *p, k, factor), xs, ref,
                lambda r, y, aux, z: (y * gs[r]).sum().double() + a_aux * aux.double() + a_z * z.double(), me)
            layer.zero_grad()
            x = xs[me].detach().clone().requires_grad_(True)
            y, aux = layer(x)
            assert y.shape == x.shape and y.dtype == dtype, f"{where}: y must be {dtype} {tuple(x.shape)}, got {y.dtype} {tuple(y.shape)}"
            torch.autograd.backward([y, aux, layer.z_loss], [gs[me], torch.tensor(a_aux, dtype=aux.dtype),
                                                             torch.tensor(a_z, dtype=layer.z_loss.dtype)])
            near(y, ref_y, where + ": output = shared experts + routed experts (one process)")
            near(aux, ref_aux, where + ": load-balancing loss")
            near(layer.z_loss, ref_z, where + ": z-loss")
            near(x.grad, xs[me].grad, where + ": input gradient for a random incoming gradient")
            mine = slice(me * c["local"], (me + 1) * c["local"])
            check_shared_grads(layer, ref_grads, terms, mine, group, where)


def check_shared_grads(layer, ref_grads, terms, mine, group, what: str) -> None:
    """The routed experts' gradients (mine: this rank's slice) and the replicated ones (gate,
    shared experts: summed over the group) against ``reference_over_ranks``'s."""
    near(layer.w1.grad, ref_grads[1][mine], what + ": w1 gradient of my routed experts", terms[1][mine])
    near(layer.w2.grad, ref_grads[2][mine], what + ": w2 gradient of my routed experts", terms[2][mine])
    ref_sw1, ref_sw2 = fused(ref_grads[3], ref_grads[4])
    sw_terms = fused(terms[3], terms[4])
    for got, want, pname, scale in ((layer.gate, ref_grads[0], "gate", terms[0]),
                                    (layer.shared_w1, ref_sw1, "shared_w1", sw_terms[0]),
                                    (layer.shared_w2, ref_sw2, "shared_w2", sw_terms[1])):
        assert got.grad is not None, f"{what}: {pname} got no gradient"
        total = got.grad.clone()
        dist.all_reduce(total, group=group)
        near(total, want, what + f": {pname} gradient summed over the group (replicated, like the gate)", scale)


def shared_overlap_on_rank(drawn: list = ()) -> None:
    from labkit.moe import SharedExpertMoE, init_experts, init_shared_experts
    rank = dist.get_rank()
    groups = groups_of_world()
    shared_drawn_on_rank(drawn)
    overlap_function_on_rank(groups)
    with CommTracer() as tracer:  # bad input: a clear error before any communication
        for kwargs in (dict(num_shared=0), dict(num_shared=-1), dict(shared_ffn=0)):
            with pytest.raises(ValueError):
                SharedExpertMoE(L_HIDDEN, L_FFN, 4, **kwargs)
    assert not tracer.events, f"moe.shared_overlap: bad input must fail before any communication, traced {tracer.ops()}"
    salt = 0
    for group_name, members, group in groups:
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        for name, num_experts, k, factor, uneven, dtype, shared in shared_cases(m, group is None):
            salt += 1
            local = num_experts // m
            what = f"moe.shared_overlap: rank {rank}, {group_name}, E={num_experts}, {name}, {NAMES[dtype]}"
            layer = SharedExpertMoE(L_HIDDEN, L_FFN, num_experts, k, factor, group=group, seed=salt, dtype=dtype,
                                    num_shared=shared, shared_ffn=S_FFN)
            gate, w1, w2 = init_experts(num_experts, L_HIDDEN, L_FFN, salt, dtype)
            sw1, sw2 = init_shared_experts(shared, L_HIDDEN, S_FFN, salt, dtype)
            if uneven:
                gate = skewed_gate(gate)
                with torch.no_grad():
                    layer.gate.copy_(gate)
            xs = [layer_tokens(r, 300 + salt, dtype, uneven).requires_grad_(True) for r in range(m)]
            ref = [p.clone().requires_grad_(True) for p in (gate, w1, w2, sw1, sw2)]
            (ref_y, ref_aux, ref_z), ref_grads, terms = reference_over_ranks(
                lambda x, *p: shared_reference(x, *p, k, factor), xs, ref,
                lambda r, y, aux, z: y.double().pow(2).sum() + aux.double() + z.double(), me)
            x = xs[me].detach().clone().requires_grad_(True)
            with SharedTracer(members, what, (S_FFN, shared * S_FFN)) as tracer:
                y, aux = layer(x)
                (y.double().pow(2).sum() + aux.double() + layer.z_loss.double()).backward()
            near(y, ref_y, what + ": output = shared experts + routed experts (one process, every expert)")
            near(aux, ref_aux, what + ": load-balancing loss")
            near(layer.z_loss, ref_z, what + ": z-loss")
            near(x.grad, xs[me].grad, what + ": input gradient (shared experts, combine, routed experts, dispatch)")
            mine = slice(me * local, (me + 1) * local)
            check_shared_grads(layer, ref_grads, terms, mine, group, what)
            routing = reference_routing([t.detach() for t in xs], gate, k, factor, num_experts)
            sent = routing[me][0].numel()
            received = sum(((kept // local) == me).sum().item() for kept, _ in routing)
            assert tuple(layer.routed_rows) == (sent, received), \
                f"{what}: routed_rows must be (rows sent, rows received) = {(sent, received)}, got {layer.routed_rows}"
            row = max(sent, received) * L_HIDDEN * torch.tensor([], dtype=dtype).element_size()
            assert_sequence(tracer, [Op("all_to_all", num_experts * 8, members)] + 4 * [Op("all_to_all", row, members)],
                            what + f" (in group {members}: counts E x 8 B, dispatch, combine, and both in backward: "
                                   f"max({sent} sent, {received} received) rows x H x element size; the shared "
                                   f"experts send nothing)")
            assert [e.dtype for e in tracer.events] == [torch.int64] + 4 * [dtype], \
                f"{what}: counts as int64, rows as {dtype}: traced {[e.dtype for e in tracer.events]}"
            assert [e.in_backward for e in tracer.events] == [False] * 3 + [True] * 2, \
                f"{what}: counts, dispatch, combine forward, then the two reverse all-to-alls in backward"
            check_shared_overlap(tracer, what)
            if "drops" in name:  # the case is what it says
                assert sum(kept.numel() for kept, _ in routing) < sum(ex.numel() for _, ex in routing), \
                    f"test set-up ({what}): capacity should drop some choices"
    for group_name, members, group in groups[:1] + groups[1:][-1:]:  # several steps: the world and the last subgroup
        if rank not in members:
            continue
        m, me = len(members), members.index(rank)
        for name, k, factor, shared, width, frozen, make_opt in [
                ("AdamW, k=3, capacity 1.5, 2 shared of the routed width (shared_ffn=None)", 3, 1.5, 2, None, False,
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
                ("momentum SGD, k=1, dropless, 1 shared, gate and shared experts frozen", 1, None, 1, S_FFN, True,
                 lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9))]:
            num_experts = 2 * m if m > 1 else 4
            local = num_experts // m
            what = f"moe.shared_overlap: rank {rank}, {group_name}, E={num_experts}, {name}"
            layer = SharedExpertMoE(L_HIDDEN, L_FFN, num_experts, k, factor, group=group, seed=19,
                                    dtype=torch.float64, num_shared=shared, shared_ffn=width)
            ref = [p.clone().requires_grad_(not frozen or i in (1, 2)) for i, p in enumerate(
                init_experts(num_experts, L_HIDDEN, L_FFN, 19, torch.float64)
                + init_shared_experts(shared, L_HIDDEN, width or L_FFN, 19, torch.float64))]
            if frozen:
                for p in (layer.gate, layer.shared_w1, layer.shared_w2):
                    p.requires_grad_(False)
            opt = make_opt([p for p in layer.parameters() if p.requires_grad])
            ref_opt = make_opt([p for p in ref if p.requires_grad])
            for step in range(3):
                xs = [layer_tokens(r, 60 + step, torch.float64, False) for r in range(m)]
                y, aux = layer(xs[me])
                loss = y.pow(2).mean() + 0.01 * aux
                opt.zero_grad()
                loss.backward()
                for p in (layer.gate, layer.shared_w1, layer.shared_w2):  # replicated: summed like the reference's
                    if not frozen:
                        dist.all_reduce(p.grad, group=group)
                opt.step()
                ref_losses = [shared_reference(x, *ref, k, factor) for x in xs]
                ref_loss = sum(y.pow(2).mean() + 0.01 * a for y, a, _ in ref_losses)
                ref_opt.zero_grad()
                ref_loss.backward()
                ref_opt.step()
                total = loss.detach().clone()
                dist.all_reduce(total, group=group)
                near(total, ref_loss.detach(), f"{what}, step {step + 1}: loss summed over the group")
                near(layer.w1, ref[1][me * local:(me + 1) * local], f"{what}, after step {step + 1}: my w1")
                near(layer.w2, ref[2][me * local:(me + 1) * local], f"{what}, after step {step + 1}: my w2")
                near(layer.gate, ref[0], f"{what}, after step {step + 1}: gate")
                sw1, sw2 = fused(ref[3], ref[4])
                near(layer.shared_w1, sw1, f"{what}, after step {step + 1}: shared_w1")
                near(layer.shared_w2, sw2, f"{what}, after step {step + 1}: shared_w2")


@task("moe.router", points=1)
@pytest.mark.parametrize("world_size", [1, 2])
def test_router(world_size):
    run_graded("moe.router", router_on_rank, world_size, draw_router(world_size))


@task("moe.capacity", points=1)
@pytest.mark.parametrize("world_size", [1, 2])
def test_capacity(world_size):
    run_graded("moe.capacity", capacity_on_rank, world_size, draw_capacity(world_size))


@task("moe.dispatch", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dispatch(world_size):
    run_graded("moe.dispatch", dispatch_on_rank, world_size, draw_dispatch(world_size))


@task("moe.layer", points=3)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layer(world_size):
    run_graded("moe.layer", layer_on_rank, world_size)


@task("moe.layer", points=1)
@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_drawn(world_size):
    run_graded("moe.layer", layer_drawn_on_rank, world_size, configs.announce(), 40 if LONG else 6, timeout=300 if LONG else 90)


@task("moe.ep_dp", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ep_dp(world_size):
    run_graded("moe.ep_dp", ep_dp_on_rank, world_size, draw_ep_dp(world_size), timeout=120)


@task("moe.bias_balance", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bias_balance(world_size):
    run_graded("moe.bias_balance", bias_balance_on_rank, world_size, configs.announce("moe.bias_balance"))


@task("moe.shared_overlap", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shared_overlap(world_size):
    run_graded("moe.shared_overlap", shared_overlap_on_rank, world_size, draw_shared(world_size))
