# ============================================================ perf.step, perf.search (perf-B)
#
# The step-time model is checked against things it does not compute itself: the pipeline's
# makespan and peak in-flight micro-batches from a brute-force simulation of the schedule
# (labkit.pp.simulate, the chapter-06 clock, on schedules built here), the FLOPs of the whole
# step (flops_per_token x tokens over all GPUs), the parameters of every rank summed back to
# Model.params(), the ZeRO sharding ratios, chapter 00's alpha-beta times of the bytes each
# chapter derived (on the link the test picks: NVLink inside a node, the network across), both
# branches of the DP overlap, and for the search a brute force over every layout of a small
# cluster. Tolerance: 1e-9 relative (pure float arithmetic, a few operations deep).

import itertools as _it
from dataclasses import replace as _replace

import pytest as _pytest

from labkit.course.grading import task as _task

_REL = 1e-9


def _close(got, want, what):
    assert abs(got - want) <= _REL * max(abs(want), 1e-30), \
        f"{what}: got {got!r}, expected {want!r} (off by {got - want:+.3g})"


def _cluster(memory=80e9, achieved=50e12, nvlink=(2e-6, 100e9), network=(20e-6, 5e9), per_node=4, rails=True):
    from labkit.perf import Cluster, Hardware, Link
    gpu = Hardware("test GPU", peak_flops=100e12, memory_bandwidth=1e12, memory_bytes=memory, achieved_flops=achieved)
    return Cluster(gpu, nvlink=Link(*nvlink), network=Link(*network), gpus_per_node=per_node, rails=rails)


def _dense(**kw):
    from labkit.perf import Model
    return Model(**dict(dict(layers=8, hidden=256, heads=8, vocab=1000, seq=128, name="dense"), **kw))


def _moe(**kw):
    from labkit.perf import Model
    return Model(**dict(dict(layers=8, hidden=256, heads=8, kv_heads=2, vocab=1000, seq=128, gated=True, ffn=512,
                             experts=8, top_k=2, shared_experts=1, expert_ffn=128, dense_layers=1, name="moe"), **kw))


# the chapter-06 schedules, written here (the grader does not lean on the learner's labkit.pp)
def _schedule(kind, p, m, v):
    from labkit.pp import Action
    if kind == "gpipe":
        return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)] for s in range(p)]
    if kind == "1f1b":
        out = []
        for s in range(p):
            w = min(p - 1 - s, m)
            acts = [Action("F", i, s) for i in range(w)]
            for j in range(m - w):
                acts += [Action("F", w + j, s), Action("B", j, s)]
            out.append(acts + [Action("B", i, s) for i in range(m - w, m)])
        return out
    out = []
    for r in range(p):
        def fwd(k):
            return Action("F", (k // (p * v)) * p + k % p, ((k // p) % v) * p + r)

        def bwd(k):
            return Action("B", (k // (p * v)) * p + k % p, (v - 1 - (k // p) % v) * p + r)
        w = min((v - 1) * p + 2 * (p - 1 - r), m * v)
        acts = [fwd(k) for k in range(w)]
        for j in range(m * v - w):
            acts += [fwd(w + j), bwd(j)]
        out.append(acts + [bwd(k) for k in range(m * v - w, m * v)])
    return out


def _terms(st):
    return st.compute + st.recompute + st.tp_comm + st.cp_comm + st.ep_comm + st.pp_comm + st.bubble + st.dp_exposed


@_task("perf.step", points=3)
def test_step_pipeline_matches_a_simulation_of_the_schedule():
    """For GPipe, 1F1B and interleaved (v = 1, 2, 4) over p = 2..4 and several m: the step's
    pipeline time (dp = 1: no DP term) equals the makespan of the schedule simulated with each
    micro-batch's forward and backward costs (split 1 : 2, over v chunks), and the activations
    the first and last ranks keep equal the simulated peak in-flight micro-batches."""
    from labkit import budget, pp
    from labkit.perf import Layout, in_flight, memory_per_gpu, step_time
    model, cluster = _dense(layers=8), _cluster()
    cases = [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 2, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
             ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 4), ("interleaved", 4, 4, 1)]
    for kind, p, m, v in cases:
        for b in (1, 2):
            layout = Layout(pp=p, microbatch=b, schedule=kind, virtual=v, zero=0)
            where = f"perf.step: {layout}, m={m}"
            st = step_time(model, layout, cluster, global_batch=m * b)
            assert st.microbatches == m, f"{where}: microbatches={st.microbatches}, expected {m}"
            per_mb = (st.compute + st.recompute + st.tp_comm + st.cp_comm + st.ep_comm + st.pp_comm) / m
            timeline = pp.simulate(_schedule(kind, p, m, v), p * v, {"F": per_mb / 3 / v, "B": 2 * per_mb / 3 / v})
            _close(st.total, timeline.makespan, f"{where}: step time vs the simulated makespan")
            _close(st.bubble / st.total, timeline.bubble(), f"{where}: bubble fraction vs the simulation's idle share")
            _close(_terms(st), st.total, f"{where}: total vs the sum of its terms")
            for rank in (0, p - 1):
                held = timeline.peak_in_flight[rank] / v
                _close(in_flight(kind, p, m, v, rank), held, f"{where}: in_flight(rank {rank})")
                want = budget.korthikanti_activation_bytes(model.layers // p, model.seq, model.hidden, model.heads,
                                                           micro=b, held=held)
                if rank == p - 1:      # the last stage also keeps its micro-batch's fp32 logits
                    want += 4 * model.seq * b * model.vocab
                got = memory_per_gpu(model, layout, m * b, rank)["activations"]
                _close(got, want, f"{where}: activations of rank {rank}")


@_task("perf.step", points=2)
def test_step_compute_recompute_throughput_and_mfu():
    """Compute = the step's FLOPs (flops_per_token x every token) over all GPUs at the achieved
    FLOP/s (the peak when achieved is None); recompute = the extra FLOPs of the mode; tokens/s
    and MFU from the total; for every axis and mode."""
    from labkit.perf import Layout, flops_per_token, step_time
    fast = _cluster(nvlink=(0.0, 1e18), network=(0.0, 1e18))
    layouts = [Layout(), Layout(dp=2, tp=2, zero=2, microbatch=2), Layout(tp=2, pp=2, recompute="selective"),
               Layout(dp=2, cp=2, zero=3, recompute="full"), Layout(pp=2, schedule="interleaved", virtual=2),
               Layout(dp=4, ep=2, zero=0, microbatch=4, recompute="full")]
    for model in (_dense(), _moe()):
        for layout in layouts:
            if layout.ep > 1 and not model.experts:
                continue
            for achieved in (50e12, None):
                cluster = _cluster(achieved=achieved) if achieved is None else fast
                rate = achieved or 100e12
                batch = 16
                where = f"perf.step: {model.name} {layout}, achieved={achieved}"
                st = step_time(model, layout, cluster, batch)
                tokens = batch * model.seq
                _close(st.compute, flops_per_token(model) * tokens / (layout.gpus * rate), f"{where}: compute")
                extra = flops_per_token(model, layout.recompute) - flops_per_token(model)
                _close(st.recompute, extra * tokens / (layout.gpus * rate), f"{where}: recompute")
                _close(st.tokens_per_second, tokens / st.total, f"{where}: tokens/s")
                _close(st.mfu, tokens / st.total * flops_per_token(model) / (layout.gpus * 100e12), f"{where}: MFU")
                _close(_terms(st), st.total, f"{where}: total vs the sum of its terms")
                assert layout.recompute != "none" or st.recompute == 0, f"{where}: recompute without recomputation"
                text = st.explain()
                for word in ("compute", "bubble", "tp_comm", "dp_exposed", "total", "GiB", "MFU"):
                    assert word in text, f"{where}: explain() does not mention {word!r}:\n{text}"


@_task("perf.step", points=3)
def test_step_communication_terms_on_the_right_links():
    """TP/SP, CP, PP and EP terms against chapter 00's alpha-beta times of the bytes chapters
    05, 06, 07 and 10 derive, on the link each group must use: a group inside a node (4 GPUs
    here) on NVLink, one that spans nodes on the network (without rails: the node's NIC shared)."""
    from labkit.perf import Layout, collective_time, layers_on_rank, step_time
    e = 2
    for rails in (True, False):
        cluster = _cluster(rails=rails)
        nv, net = cluster.nvlink, cluster.network

        def link(size, stride):
            if 4 % (size * stride) == 0:
                return nv
            from labkit.perf import Link
            return net if rails else Link(net.alpha, net.bandwidth / min(stride, 4))
        for model in (_dense(), _moe()):
            for layout in [Layout(tp=2, zero=0), Layout(tp=8, recompute="full"), Layout(tp=4, pp=2, microbatch=2),
                           Layout(dp=2, tp=2, cp=2, recompute="selective"), Layout(tp=2, cp=4, recompute="full"),
                           Layout(pp=2, cp=2, tp=2, schedule="interleaved", virtual=2),
                           Layout(dp=8, ep=4, recompute="full"), Layout(dp=4, tp=2, ep=2, zero=3)]:
                if layout.ep > 1 and not model.experts:
                    continue
                m = 8
                batch = m * layout.dp * layout.microbatch
                st = step_time(model, layout, cluster, batch)
                where = f"perf.step: {model.name} {layout} rails={rails}"
                tp, cp, pp, v, b = layout.tp, layout.cp, layout.pp, layout.virtual, layout.microbatch
                full = layout.recompute == "full"
                act = model.seq // cp * b * model.hidden * e            # one layer's activation on a CP rank
                # TP + SP: the bytes of 4 all-reduces of the activation per layer (6 with full recompute)
                want = m * model.layers // pp * (6 if full else 4) * collective_time("all_reduce", act, tp, link(tp, 1))
                _close(st.tp_comm, want, f"{where}: tp_comm")
                # ring attention: K and V of s/cp tokens, cp-1 hops forward, twice that backward (+1 full)
                kv = 2 * model.seq // cp * b * max(model.kv_heads_ // tp, 1) * model.head_size * e
                want = m * model.layers // pp * (cp - 1) * (4 if full else 3) * collective_time("send", kv, cp, link(cp, tp))
                _close(st.cp_comm, want, f"{where}: cp_comm")
                # PP: an activation shard forward, its gradient backward, per model chunk
                want = m * 2 * v * collective_time("send", act / tp, pp, link(pp, tp * cp)) if pp > 1 else 0.0
                _close(st.pp_comm, want, f"{where}: pp_comm")
                # EP: dispatch + combine, forward and backward (+ forward again with full recompute)
                moe_layers = max(layers_on_rank(model, layout, r)[1] for r in range(pp))
                tokens = model.seq // cp * b // tp * model.top_k * model.hidden * e
                want = m * moe_layers * (6 if full else 4) * collective_time(
                    "all_to_all", tokens, layout.ep, link(layout.ep, tp * cp * pp)) if layout.ep > 1 else 0.0
                _close(st.ep_comm, want, f"{where}: ep_comm")


@_task("perf.step", points=3)
def test_step_data_parallel_bytes_and_overlap():
    """DP/ZeRO/FSDP: the gradient (and parameter) traffic of the rank's parameters over dp x cp
    ranks (experts over dp x cp / ep): ZeRO-0 an all-reduce, 1 and 2 a reduce-scatter + an
    all-gather, 3 per micro-batch two all-gathers and a reduce-scatter; exposed = what backward
    (ZeRO-0), backward + the first forward (1, 2), or every micro-batch (3) does not hide, with
    both branches reached: a slow network exposes part, a fast one hides all."""
    from labkit.perf import Layout, collective_time, parameters_per_gpu, step_time
    model = _dense()
    m = 4
    for zero in (0, 1, 2, 3):
        for layout in (Layout(dp=8, zero=zero), Layout(dp=2, tp=2, pp=2, zero=zero, microbatch=2),
                       Layout(dp=2, cp=2, zero=zero, recompute="full"), Layout(dp=4, tp=2, zero=zero)):
            for network, exposed in (((20e-6, 1e9), True), ((0.0, 1e15), False)):
                cluster = _cluster(network=network, nvlink=(0.0, 1e15) if not exposed else (2e-6, 1e9))
                batch = m * layout.dp * layout.microbatch
                st = step_time(model, layout, cluster, batch)
                where = f"perf.step: {layout}, network={network}"
                dense = max(parameters_per_gpu(model, layout, r)[0] for r in range(layout.pp))
                size = layout.dp * layout.cp
                stride = layout.tp * layout.cp * layout.pp
                net = cluster.nvlink if 4 % (size * stride) == 0 else cluster.network
                ar = collective_time("all_reduce", 2 * dense, size, net)
                want = {0: ar, 1: ar, 2: ar, 3: 1.5 * m * ar}[zero]
                _close(st.dp_comm, want, f"{where}: dp_comm")
                mb = (st.compute + st.recompute) / m
                hides = {0: st.compute / m * 2 / 3 + st.recompute / m, 1: mb, 2: mb, 3: m * mb}[zero]
                _close(st.dp_exposed, max(0.0, want - hides), f"{where}: dp_exposed (hidden behind {hides:.3g} s)")
                assert (st.dp_exposed > 0) == exposed, \
                    f"{where}: dp_exposed={st.dp_exposed:.3g} s of dp_comm={st.dp_comm:.3g} s; expected " \
                    + ("part of it exposed" if exposed else "all of it hidden")
    # experts: their gradients go over dp x cp / ep ranks, the dense ones over dp x cp
    moe, cluster = _moe(), _cluster()
    for layout in (Layout(dp=8, ep=2, zero=0), Layout(dp=4, ep=2, cp=2, zero=1), Layout(dp=8, ep=8, zero=2)):
        st = step_time(moe, layout, cluster, 8 * layout.dp)
        dense, experts = parameters_per_gpu(moe, layout, 0)
        want = collective_time("all_reduce", 2 * dense, layout.dp * layout.cp, cluster.network)
        rest = layout.dp * layout.cp // layout.ep
        if rest > 1:
            want += collective_time("all_reduce", 2 * experts, rest, cluster.network)
        _close(st.dp_comm, want, f"perf.step: MoE {layout}: dp_comm")


@_task("perf.step", points=2)
def test_step_memory_parameters_and_zero():
    """Every rank's parameters, summed over the TP, EP and PP ranks of one replica, give back
    Model.params() (plus the output layer's own copy when a tied model is pipelined, and the
    router's copies on every TP rank); ZeRO
    shards the optimizer state from stage 1, the gradients from 2, the parameters at 3, over
    dp x cp (experts over dp x cp / ep); 16 bytes a parameter unsharded; fits <=> memory <= the GPU's."""
    from labkit.perf import Layout, memory_per_gpu, parameters_per_gpu, step_time
    for model in (_dense(), _dense(tied=True), _moe(), _moe(tied=True)):
        for tp, pp, v, ep in [(1, 1, 1, 1), (2, 2, 1, 1), (4, 1, 1, 2), (1, 4, 2, 2), (2, 2, 2, 4), (1, 8, 1, 1)]:
            if ep > 1 and not model.experts:
                continue
            layout = Layout(dp=ep, tp=tp, pp=pp, ep=ep, schedule="interleaved" if v > 1 else "1f1b", virtual=v)
            total = sum(tp * d + tp * ep * x for d, x in (parameters_per_gpu(model, layout, r) for r in range(pp)))
            want = model.params() + (model.vocab * model.hidden if model.tied and pp > 1 else 0) \
                + (tp - 1) * model.moe_layers * model.hidden * model.experts     # every TP rank keeps the router
            _close(total, want, f"perf.step: {model.name} tied={model.tied} {layout}: parameters summed over the ranks")
    model = _moe()
    base = Layout(dp=4, cp=2, ep=2, tp=2, pp=2, zero=0, microbatch=2)
    for rank in (0, 1):
        ref = memory_per_gpu(model, base, 32, rank)
        dense, experts = parameters_per_gpu(model, base, rank)
        _close(ref["params"], 2 * (dense + experts), f"perf.step: {base} rank {rank}: 16-bit parameters")
        _close(ref["optimizer"], 12 * (dense + experts), f"perf.step: {base} rank {rank}: AdamW state")
        for zero in (1, 2, 3):
            got = memory_per_gpu(model, _replace(base, zero=zero), 32, rank)
            for part, stage in (("optimizer", 1), ("grads", 2), ("params", 3)):
                factor = 2 if part != "optimizer" else 12
                want = factor * (dense / 8 + experts / 4) if zero >= stage else ref[part]
                _close(got[part], want, f"perf.step: ZeRO-{zero} rank {rank}: {part}")
            _close(got["activations"], ref["activations"], f"perf.step: ZeRO-{zero}: activations")
            _close(got["total"], got["params"] + got["grads"] + got["optimizer"] + got["activations"], "total")
    # fits: the fullest rank against the GPU's memory, both ways; step_time's memory is the fullest rank's
    layout = Layout(dp=2, tp=2, pp=2, zero=1, microbatch=2, recompute="selective")
    fullest = max(memory_per_gpu(model, layout, 16, r)["total"] for r in range(2))
    for memory, fits in ((fullest * 1.001, True), (fullest * 0.999, False)):
        st = step_time(model, layout, _cluster(memory=memory), 16)
        _close(st.memory, fullest, f"perf.step: {layout}: memory")
        assert st.fits == fits, f"perf.step: {layout}: {st.memory:.4g} bytes on a {memory:.4g}-byte GPU, fits={st.fits}"
    # recomputation shrinks activations: full < selective < none
    acts = [memory_per_gpu(model, _replace(layout, recompute=r), 16, 0)["activations"]
            for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2], f"perf.step: activations none/selective/full = {acts}"


@_task("perf.step", points=1)
def test_step_refuses_bad_layouts():
    """A layout that cannot run the model or the batch raises ValueError, naming the problem."""
    from labkit.perf import Layout, step_time
    model, cluster = _moe(), _cluster()
    bad = [(Layout(dp=0), 8, None, "dp"), (Layout(tp=3), 12, None, "heads"), (Layout(pp=3), 12, None, "layers"),
           (Layout(pp=2, schedule="interleaved", virtual=8), 8, None, "layers"),
           (Layout(dp=2, tp=2), 8, 8, "8"), (Layout(dp=3), 8, None, "batch"),
           (Layout(dp=2, microbatch=3), 8, None, "batch"), (Layout(cp=3), 9, None, "cp"),
           (Layout(zero=4), 8, None, "ZeRO"), (Layout(schedule="zigzag"), 8, None, "schedule"),
           (Layout(recompute="some"), 8, None, "recompute"), (Layout(pp=2, virtual=2), 8, None, "interleaved"),
           (Layout(schedule="interleaved"), 8, None, "pp"), (Layout(pp=4, schedule="interleaved"), 6, None, "multiple"),
           (Layout(dp=2, ep=4), 8, None, "ep"), (Layout(dp=4, ep=3), 12, None, "ep"), (Layout(), 0, None, "batch")]
    for layout, batch, gpus, word in bad:
        with _pytest.raises(ValueError) as error:
            step_time(model, layout, cluster, batch, gpus=gpus)
            _pytest.fail(f"perf.step: {layout} with a batch of {batch} (gpus={gpus}) did not raise ValueError")
        assert word.lower() in str(error.value).lower(), \
            f"perf.step: {layout} (batch {batch}, gpus {gpus}) raised {error.value!r}, which does not name {word!r}"
    with _pytest.raises(ValueError):
        step_time(_dense(), Layout(dp=2, ep=2), cluster, 8)          # experts in a dense model


# ----------------------------------------------------------------------------- perf.search


def _brute_force(model, cluster, gpus, batch, zeros, micro, schedules, virtuals, recomputes, max_cp):
    """Every Layout the search's limits allow, tried with step_time (ValueError: not a layout)."""
    from labkit.perf import Layout, step_time
    found = []
    for dp, tp, pp, cp in _it.product(range(1, gpus + 1), repeat=4):
        if dp * tp * pp * cp != gpus or cp > max_cp:
            continue
        for ep, zero, b, schedule, v, r in _it.product(range(1, dp + 1), zeros, micro, schedules, (1,) + virtuals,
                                                       recomputes):
            if (schedule == "interleaved") != (v > 1):
                continue
            layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, microbatch=b, schedule=schedule,
                            virtual=v, recompute=r)
            try:
                st = step_time(model, layout, cluster, batch, gpus=gpus)
            except ValueError:
                continue
            if st.fits:
                found.append((layout, st))
    return found


@_task("perf.search", points=3)
def test_search_equals_brute_force():
    """On 8 GPUs in nodes of 4, for a dense and an MoE model: the search's ranking equals a
    brute force over every layout step_time accepts (the search's own conventions: one ZeRO
    stage when dp x cp = 1, "1f1b" only without a pipeline), the best is the minimum of
    step_time over ALL valid layouts, every result fits, ties go to less memory then Layout.key,
    and ``top`` cuts the list."""
    from labkit.perf import search_layouts
    limits = dict(zero=(0, 1, 3), microbatch=(1, 2), schedules=("gpipe", "1f1b", "interleaved"), virtual=(2,),
                  recompute=("none", "full"), max_cp=2)
    for model, memory in ((_dense(layers=4, hidden=512, seq=256), 0.2e9), (_moe(layers=4), 0.05e9)):
        cluster = _cluster(memory=memory)
        batch = 8
        everything = _brute_force(model, cluster, 8, batch, limits["zero"], limits["microbatch"],
                                  limits["schedules"], limits["virtual"], limits["recompute"], 2)
        assert everything, "test set-up: some layout must fit"
        unlimited = _brute_force(model, _cluster(memory=1e15), 8, batch, limits["zero"], limits["microbatch"],
                                 limits["schedules"], limits["virtual"], limits["recompute"], 2)
        assert len(everything) < len(unlimited), "test set-up: the memory limit must rule some layouts out"
        kept = [(l, st) for l, st in everything
                if (l.zero == limits["zero"][0] or l.dp * l.cp > 1) and (l.pp > 1 or l.schedule == "1f1b")]
        kept.sort(key=lambda item: (item[1].total, item[1].memory, item[0].key()))
        for top in (1, 4, len(kept) + 3):
            got = search_layouts(model, cluster, 8, batch, top=top, **limits)
            want = kept[:top]
            where = f"perf.search: {model.name}, top={top}"
            assert [l for l, _ in got] == [l for l, _ in want], \
                f"{where}: ranked {[str(l) for l, _ in got][:6]}; the brute force ranks {[str(l) for l, _ in want][:6]}"
            for (layout, st), (_, ref) in zip(got, want):
                _close(st.total, ref.total, f"{where}: {layout} total")
                assert st.fits, f"{where}: {layout} does not fit ({st.memory:.3g} bytes)"
            best = min(st.total for _, st in everything)
            _close(got[0][1].total, best, f"{where}: the best layout's step vs the minimum over all valid layouts")
    with _pytest.raises(ValueError):
        search_layouts(_dense(), _cluster(), 8, 8, top=0)


@_task("perf.search", points=2)
def test_search_default_limits_and_the_winner():
    """With its default limits the search agrees with step_time on what it returns, never
    returns a layout that does not fit, returns nothing when nothing fits, and moves TP off a
    slow network: with nodes of 2 GPUs and a slow network its winner keeps tp inside a node,
    with nodes of 8 it may use tp up to 8."""
    from labkit.perf import search_layouts, step_time
    model = _dense(layers=8, hidden=1024, heads=16, seq=512)
    for per_node, network in ((2, (50e-6, 1e8)), (8, (50e-6, 1e8))):
        cluster = _cluster(per_node=per_node, network=network, nvlink=(1e-6, 300e9), memory=4e9)
        got = search_layouts(model, cluster, 16, 64)
        assert len(got) == 5, f"perf.search: {len(got)} layouts returned, expected the default top 5"
        for layout, st in got:
            again = step_time(model, layout, cluster, 64, gpus=16)
            _close(st.total, again.total, f"perf.search: {layout}: its StepTime vs step_time's")
            assert st.fits and layout.gpus == 16 and layout.cp == 1, f"perf.search: {layout} (default max_cp=1)"
        totals = [st.total for _, st in got]
        assert totals == sorted(totals), f"perf.search: not fastest first: {totals}"
        assert per_node == 8 or got[0][0].tp <= per_node, \
            f"perf.search: nodes of {per_node}, slow network, but the winner is {got[0][0]}"
    assert search_layouts(model, _cluster(memory=1e6), 16, 64) == [], "perf.search: nothing fits in 1 MB"
    # max_tp and max_ep cut the candidates, nothing else: the limited ranking is the full one filtered
    for model, limit, axis in ((model, 2, "tp"), (_moe(layers=4), 2, "ep")):
        cluster = _cluster(per_node=2, memory=4e9)
        full = search_layouts(model, cluster, 16, 64, top=10**6)
        limited = search_layouts(model, cluster, 16, 64, top=5, **{f"max_{axis}": limit})
        want = [layout for layout, _ in full if getattr(layout, axis) <= limit][:5]
        assert [layout for layout, _ in limited] == want, \
            f"perf.search: max_{axis}={limit} returned {[str(l) for l, _ in limited]}, expected {[str(l) for l in want]}"
        assert any(getattr(layout, axis) > limit for layout, _ in full), f"test set-up: some layout has {axis} > {limit}"
