"""Chapter 14's published runs (labkit/course/runs.py): the data holds together, and the step
model (labkit.perf, reference solution) predicts every run within +-15% or says why not."""

import math
import sys
from functools import lru_cache

import pytest

perf = pytest.importorskip("labkit.perf")
from labkit.course import runs as R  # noqa: E402
from tests.conftest import needs_solutions  # noqa: E402


@lru_cache(maxsize=None)
def evaluated():
    fit = R.fit_efficiency(R.RUNS)
    return fit, R.evaluate(R.RUNS, fit)


def test_there_are_enough_runs_each_cited_and_sourced():
    assert len(R.RUNS) >= 8
    assert len({r.name for r in R.RUNS}) == len(R.RUNS), "run names must be unique"
    for r in R.RUNS:
        assert r.citation and any(k in r.citation for k in ("arXiv:", "README", "commit")), f"{r.name}: no citation"
        assert r.stack in R.STACKS, f"{r.name}: stack {r.stack!r} not in STACKS"
        assert r.verified, f"{r.name}: say which numbers were checked against a source"
        assert r.kind in R.KINDS or r.kind == "step_s", f"{r.name}: unknown kind {r.kind}"
        assert r.gpu in perf.HARDWARE, f"{r.name}: {r.gpu} not in perf.HARDWARE"
        assert r.generation in ("Ampere", "Hopper")


def test_layouts_cover_the_gpus_and_divide_the_batch():
    for r in R.RUNS:
        lay = r.layout
        assert lay.dp * lay.tp * lay.pp * lay.cp == r.gpus, f"{r.name}: {lay} does not make {r.gpus} GPUs"
        assert r.global_batch % (lay.dp * lay.microbatch) == 0, f"{r.name}: batch {r.global_batch} vs {lay}"
        assert r.model.heads % lay.tp == 0, f"{r.name}: tp={lay.tp} does not divide {r.model.heads} heads"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_stated_parameter_counts_match_the_model_shapes():
    """perf.Model.params() leaves out biases, norms and position embeddings (and models MLA as
    plain attention): within half a unit of the paper's last digit plus 1%."""
    for r in R.RUNS:
        stated, half_unit = r.params_stated
        got = r.model.params()
        tol = half_unit / stated + 0.01
        assert abs(got / stated - 1) <= tol, f"{r.name}: {got / 1e9:.2f}B vs stated {r.stated_params} (tol {tol:.1%})"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_every_stated_figure_agrees_with_the_others():
    """e.g. MT-NLG: 126 TFLOP/s x 2240 GPUs x 60.1 s = 1920 x 2048 tokens x Narayanan's FLOPs
    per token; Megatron-Core: TFLOP/s / 989 = the stated MFU; aggregate = per GPU x GPUs."""
    checked = 0
    for r in R.RUNS:
        for kind, ratio in R.consistency(r).items():
            checked += 1
            assert abs(ratio - 1) <= r.rounding, f"{r.name}: its {kind} implies {ratio - 1:+.2%} vs its figure"
    assert checked >= 20


@needs_solutions  # prices runs with labkit.perf's reference model
def test_figures_round_trip_through_tokens_per_gpu():
    for r in R.RUNS:
        tokens = R.published_tokens_per_gpu(r)
        assert math.isclose(R.figure_of(r, tokens), r.figure, rel_tol=1e-12), r.name
        assert 0.15 < R.published_mfu(r) < 0.7, f"{r.name}: published MFU {R.published_mfu(r):.2f} is implausible"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_narayanan_formula_is_perf_full_recompute_for_a_tied_gpt():
    """The A100 runs' TFLOP/s are hardware FLOPs with full recomputation: Narayanan et al.'s
    96 l h^2 (1 + s/6h + V/16lh) is perf.flops_per_token(model, 'full') for their models."""
    for r in R.RUNS:
        if r.kind == "tflops_hw":
            ours = perf.flops_per_token(r.model, "full")
            theirs = R.narayanan_flops_per_token(r.model)
            assert math.isclose(ours, theirs, rel_tol=1e-9), f"{r.name}: perf {ours:.4e} vs Narayanan {theirs:.4e}"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_korthikanti_convention_reproduces_their_hfu_mfu_pairs():
    """perf.hfu(..., "selective", convention="korthikanti") over perf.mfu is the ratio of
    Korthikanti et al.'s published HFU and MFU for each of their four models (both rounded to
    0.1 %: the product may differ by 0.05 x ratio + 0.05 points); the course's own (PaLM's)
    convention is not, which is why the option exists."""
    peak, gpus, tokens = 312e12, 8, 1e5   # any: the ratio does not depend on them
    for name, (model, mfu, hfu) in R.KORTHIKANTI_UTILIZATION.items():
        base = perf.mfu(tokens, model, gpus, peak)
        theirs = perf.hfu(tokens, model, gpus, peak, "selective", convention="korthikanti") / base
        palm = perf.hfu(tokens, model, gpus, peak, "selective") / base
        bound = 0.05 * theirs + 0.05
        assert abs(mfu * theirs - hfu) <= bound, f"{name}: {mfu} % MFU x {theirs:.4f} = {mfu * theirs:.2f} % HFU, published {hfu}"
        assert abs(mfu * palm - hfu) > bound, f"{name}: PaLM's convention also gives {mfu * palm:.2f} %"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_at_most_a_third_fitted_one_per_stack_on_the_median_run():
    fit, preds = evaluated()
    fitted = [p for p in preds if p.fitted]
    assert len(fitted) == len(fit) <= len(R.RUNS) / 3
    for stack, (eff, name) in fit.items():
        mine = sorted((r for r in R.RUNS if r.stack == stack), key=R.published_mfu)
        assert name == mine[(len(mine) - 1) // 2].name, f"{stack}: fitted on {name}, not the median run"
        assert 0.2 < eff <= 1.0, f"{stack}: efficiency {eff:.3f}"
        p = next(p for p in preds if p.run.name == name)
        if eff < 0.999:   # a saturated fit (the model is too slow even at the peak) cannot reproduce its run
            assert abs(p.throughput_error) < 1e-3, f"{stack}: the fit does not reproduce {name} ({p.throughput_error:+.2%})"
        else:
            assert p.run.reason, f"{stack}: the fit saturates at the peak on {name}; say why"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_every_prediction_within_15_percent_or_explained():
    """One efficiency per stack (its median run): >= 2/3 of the runs within 15 %; every other
    run's miss moved towards its published figure by a computed mechanism (explain_pair)."""
    fit, preds = evaluated()
    fit_runs = {stack: next(r for r in R.RUNS if r.name == name) for stack, (_, name) in fit.items()}
    for p in preds:
        if p.within or p.fitted:
            continue
        why = R.explain_pair(R.HeldOut(fit_runs[p.run.stack], p.run, None, p))
        assert why, f"{p.run.name}: {p.throughput_error:+.1%} and no mechanism moves it towards the figure"
        assert abs(why[1]) < abs(p.throughput_error)
    assert sum(p.within for p in preds) >= 2 * len(preds) / 3, "fewer than two thirds of the runs within 15%"
    assert "NO REASON" not in R.misses(preds)


@lru_cache(maxsize=None)
def held_out():
    return tuple(R.leave_one_out(R.RUNS))


@needs_solutions  # prices runs with labkit.perf's reference model
def test_leave_one_out_two_thirds_within_15_percent_and_every_miss_computed():
    """The figure that counts: for every stack with >= 2 runs, calibrate on ONE run
    (perf.calibrate) and predict the others. >= 6 such stacks; >= 2/3 of the held-out
    predictions within 15 %; every miss moved towards its published figure by a mechanism
    whose size is computed for both runs of the pair."""
    held = held_out()
    stacks = R.stacks_of(R.RUNS)
    multi = [s for s, rs in stacks.items() if len(rs) >= 2]
    assert len(multi) >= 6, f"only {len(multi)} stacks with two runs or more"
    for s in multi:   # different sizes or GPU counts
        shapes = {(r.model.params(), r.gpus) for r in stacks[s]}
        assert len(shapes) >= 2, f"{s}: its runs do not differ in size or GPU count"
    assert len(held) == sum(len(rs) * (len(rs) - 1) for rs in stacks.values() if len(rs) >= 2)
    within = sum(h.within for h in held)
    assert within >= 2 * len(held) / 3, f"held-out: {within}/{len(held)} within 15%"
    for h in held:
        # the calibration reproduces its own run
        own = R.predict_with(h.calibration, h.stack)
        assert abs(own.throughput_error) < 1e-3 or h.stack.saturated, f"{h.calibration.name}: {own.throughput_error:+.2%}"
        if not h.within:
            why = R.explain_pair(h)
            assert why and abs(why[1]) < abs(h.error), f"{h.target.name} from {h.calibration.name}: unexplained"
    table = R.loo_table(list(held))
    assert f"{within}/{len(held)}" in table and table.count("\n") == len(multi) + 2


@needs_solutions  # prices runs with labkit.perf's reference model
def test_strict_count_of_explained_misses_and_dp_scaling_pairs():
    """loo_explained counts the misses a mechanism brings within 15 % (the strict sense of
    "explains"), consistently with loo_misses' bullets. dp_scaling: the held-out pairs of one model
    and stack at two data-parallel sizes (the same tp, pp, cp), the larger predicted from the
    smaller, at least five of them in three stacks; each row of the table is the pair's published
    and predicted change, and their ratio is the held-out error (the calibration is exact)."""
    held = list(held_out())
    missed, moved, explained = R.loo_explained(held)
    assert missed == sum(not h.within for h in held) and explained <= moved <= missed
    bullets = R.loo_misses(held)
    assert bullets.count("(within)") == explained and bullets.count("(still outside") == moved - explained
    pairs = R.dp_scaling(held)
    assert len(pairs) >= 5 and len({h.target.stack for h in pairs}) >= 3, [h.target.name for h in pairs]
    for h in pairs:
        assert h.target.model == h.calibration.model and h.target.layout.dp > h.calibration.layout.dp
        base = R.predict_with(h.calibration, h.stack)
        published = R.published_tokens_per_gpu(h.target) / R.published_tokens_per_gpu(h.calibration)
        predicted = h.prediction.tokens_per_gpu / base.tokens_per_gpu
        assert math.isclose(predicted / published - 1, h.error, rel_tol=1e-2, abs_tol=2e-3), h.target.name
    table = R.dp_scaling_table(held)
    assert table.count("\n") == len(pairs) + 1
    for h in pairs:
        assert f"{100 * h.error:+.1f}% |" in table


@needs_solutions  # prices runs with labkit.perf's reference model
def test_calibrate_inverts_step_time():
    """perf.calibrate: the stack it returns makes step_time take the measured step; from a step
    time or from tokens/s alike; a step faster than the peak allows saturates."""
    r = next(r for r in R.RUNS if r.name.startswith("MPT-7b"))
    for eff in (0.3, 0.55, 0.8):
        st = perf.step_time(r.step_model, r.layout, R.with_efficiency(r, eff), r.global_batch)
        a = perf.calibrate(r.step_model, r.layout, r.cluster, r.global_batch, step_seconds=st.total)
        b = perf.calibrate(r.step_model, r.layout, r.cluster, r.global_batch, tokens_per_second=st.tokens_per_second)
        assert math.isclose(a.matmul, eff, rel_tol=1e-6) and math.isclose(b.matmul, eff, rel_tol=1e-6)
        again = perf.step_time(r.step_model, r.layout, r.cluster, r.global_batch, stack=a)
        assert math.isclose(again.total, st.total, rel_tol=1e-6) and not a.saturated
    fast = perf.calibrate(r.step_model, r.layout, r.cluster, r.global_batch, step_seconds=1e-6)
    assert fast.saturated and fast.matmul == 1.0
    with pytest.raises(ValueError):
        perf.calibrate(r.step_model, r.layout, r.cluster, r.global_batch)


@needs_solutions  # prices runs with labkit.perf's reference model
def test_mechanisms_measure_what_they_say():
    by_name = {r.name: r for r in R.RUNS}
    # the output layer: 6Vh against pp-th of the layers; none without a pipeline or where balanced
    nem = by_name["Nemotron-4 340B, 6144 H100"]
    m = nem.model
    layers = perf.flops_per_token(m, nem.layout.recompute) - 6 * m.vocab * m.hidden
    assert math.isclose(R.stage_imbalance(nem), 6 * m.vocab * m.hidden * 12 / layers)
    assert R.stage_imbalance(by_name["Megatron GPT-1.7B, 32 A100"]) == 0
    assert R.stage_imbalance(by_name["Llama 3 405B, 8192 H100, seq 8192"]) == 0


@needs_solutions  # prices runs with labkit.perf's reference model
def test_search_ranks_the_published_layout_top_three_or_says_why():
    fit, _ = evaluated()
    top3 = 0
    for r in R.RUNS:
        if r.name not in R.SEARCH_RUNS:
            continue
        eff = fit[r.stack][0]
        rank, ranked = R.search_rank(r, eff)
        assert ranked, f"{r.name}: the search found no layout"
        if rank is None or rank > 3:
            text = R.explain_rank(r, eff, rank, ranked)
            assert text and "{" not in text, f"{r.name}: published layout ranked {rank}, no reason written"
        else:
            top3 += 1
            assert not R.SEARCH_REASONS.get(r.name), f"{r.name} ranks {rank} now: drop its search reason"
    assert top3 >= len(R.SEARCH_RUNS) / 2


@needs_solutions  # prices runs with labkit.perf's reference model
def test_table_lists_every_run_and_its_error():
    text = R.table()
    assert text.count("\n") == len(R.RUNS) + 1 and "published" in text
    _, preds = evaluated()
    text = R.table(preds, {preds[0].run.name: 1})
    for p in preds:
        assert p.run.name in text and f"{100 * p.throughput_error:+.1f}%" in text
    assert text.count("fitted on this run") == len(R.STACKS)
    missed = R.misses(preds)
    assert missed.count("\n- ") + 1 == sum(not p.within for p in preds) and "NO REASON" not in missed


def test_the_published_side_calls_no_task_region(monkeypatch):
    """The chapter prints table() (published side) and imports the module: neither may run a
    learner's solution region (in a workspace they raise NotImplementedError)."""
    def stub(*args, **kwargs):
        raise NotImplementedError("a solution region was called")
    for name in ("flops_per_token", "model_flops_per_token", "mfu", "hfu", "step_time", "search_layouts",
                 "collective_time", "group_time", "op_time"):
        for module in [perf, *(m for m in sys.modules.values() if m and m.__name__.startswith("labkit.perf."))]:
            if hasattr(module, name):   # the package and every file of it that holds or imports the name
                monkeypatch.setattr(module, name, stub)
    for name in ("attention_params", "ffn_params", "active_params"):
        monkeypatch.setattr(perf.Model, name, stub)
    assert len(R.runs()) == len(R.RUNS)
    assert R.table().count("\n") == len(R.RUNS) + 1
