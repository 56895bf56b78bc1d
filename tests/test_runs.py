"""Chapter 14's published runs (labkit/course/runs.py): the data holds together, and the step
model (labkit.perf, reference solution) predicts every run within +-15% or says why not."""

import math
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
        assert r.citation and ("arXiv:" in r.citation or "README" in r.citation), f"{r.name}: no citation"
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
        assert 0.15 < R.published_mfu(r) < 0.6, f"{r.name}: published MFU {R.published_mfu(r):.2f} is implausible"


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
def test_at_most_a_third_fitted_one_per_generation_on_the_median_run():
    fit, preds = evaluated()
    fitted = [p for p in preds if p.fitted]
    assert len(fitted) == len(fit) <= len(R.RUNS) / 3
    for gen, (eff, name) in fit.items():
        mine = sorted((r for r in R.RUNS if r.generation == gen), key=R.published_mfu)
        assert name == mine[(len(mine) - 1) // 2].name, f"{gen}: fitted on {name}, not the median run"
        assert 0.2 < eff <= 1.0, f"{gen}: efficiency {eff:.3f}"
        p = next(p for p in preds if p.run.name == name)
        assert abs(p.throughput_error) < 1e-3, f"{gen}: the fit does not reproduce {name} ({p.throughput_error:+.2%})"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_every_prediction_within_15_percent_or_explained():
    _, preds = evaluated()
    unexplained = [f"{p.run.name}: {p.throughput_error:+.1%}" for p in preds if not p.within and not p.run.reason]
    assert not unexplained, "misses without a written reason:\n  " + "\n  ".join(unexplained)
    for p in preds:  # a reason is for a miss: stale reasons go
        assert not (p.within and p.run.reason), f"{p.run.name} is within {R.TOLERANCE:.0%} now: drop its reason"
    assert sum(p.within for p in preds) >= 2 * len(preds) / 3, "fewer than two thirds of the runs within 15%"


@needs_solutions  # prices runs with labkit.perf's reference model
def test_every_miss_is_computed_not_hidden():
    """Each miss names a mechanism perf.step_time leaves out; counted for the run (and for the
    run its generation was fitted on), it must move the prediction towards the published figure."""
    fit, preds = evaluated()
    fit_runs = {gen: next(r for r in R.RUNS if r.name == name) for gen, (_, name) in fit.items()}
    for p in preds:
        if p.within:
            continue
        assert p.run.mechanism in R.CORRECTIONS, f"{p.run.name}: mechanism {p.run.mechanism!r}"
        fixed = R.corrected_error(p, fit_runs[p.run.generation], p.run.mechanism)
        assert abs(fixed) < abs(p.throughput_error), \
            f"{p.run.name}: {p.run.mechanism} moves {p.throughput_error:+.1%} to {fixed:+.1%}, not towards the figure"
        text = R.explain_miss(p, fit_runs[p.run.generation])
        assert f"{100 * fixed:+.1f}%" in text and "{" not in text, text


@needs_solutions  # prices runs with labkit.perf's reference model
def test_mechanisms_measure_what_they_say():
    by_name = {r.name: r for r in R.RUNS}
    # element-wise share falls with the width (1/h): the trend of the A100 table
    a100 = [r for r in R.RUNS if r.name.startswith("Megatron GPT-")]
    shares = [R.elementwise_share(r) for r in a100]
    assert shares == sorted(shares, reverse=True) and shares[0] > 5 * shares[-1], shares
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
        eff = fit[r.generation][0]
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
    assert text.count("fitted on this run") == 2
    missed = R.misses(preds)
    assert missed.count("\n- ") + 1 == sum(not p.within for p in preds) and "NO REASON" not in missed


def test_the_published_side_calls_no_task_region(monkeypatch):
    """The chapter prints table() (published side) and imports the module: neither may run a
    learner's solution region (in a workspace they raise NotImplementedError)."""
    def stub(*args, **kwargs):
        raise NotImplementedError("a solution region was called")
    for name in ("flops_per_token", "model_flops_per_token", "mfu", "hfu", "step_time", "search_layouts",
                 "collective_time", "group_time", "op_time"):
        monkeypatch.setattr(perf, name, stub)
    for name in ("attention_params", "ffn_params", "active_params"):
        monkeypatch.setattr(perf.Model, name, stub)
    assert len(R.runs()) == len(R.RUNS)
    assert R.table().count("\n") == len(R.RUNS) + 1
