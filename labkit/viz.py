"""Shared matplotlib figures for the chapters and labs.

Every function builds and returns a ``matplotlib.figure.Figure`` and never calls
``plt.show()`` itself. Figures are created through pyplot, so in a notebook
``viz.plot_...(...); plt.show()`` displays them (the inline backend also shows open figures
at the end of a cell: don't ``display()`` the returned figure as well, or it appears twice).
A script can ``fig.savefig(...)`` under any backend (Agg too) and ``plt.close(fig)`` after.
"""

from __future__ import annotations

import functools
import html
import io
import math
import threading
import traceback

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Rectangle

from labkit.comm import wire_bytes


def ring_schedule(world_size: int) -> list[tuple[str, int, list[tuple[int, int, int]]]]:
    """The ring all-reduce's steps as ``(phase, step, [(src, dst, chunk), ...])``.

    Rank r sends to r+1. Reduce-scatter step s (1..N-1): rank r sends its running sum of
    chunk (r-s) mod N; afterwards rank r owns the complete chunk r. All-gather step s:
    rank r forwards chunk (r-s+1) mod N, the complete chunk it got last (its own at first).
    """
    n = world_size
    steps = [("reduce-scatter", s, [(r, (r + 1) % n, (r - s) % n) for r in range(n)])
             for s in range(1, n)]
    steps += [("all-gather", s, [(r, (r + 1) % n, (r - s + 1) % n) for r in range(n)])
              for s in range(1, n)]
    return steps


def plot_ring_steps(world_size: int = 4):
    """Grid of ranks x chunks per step, coloured by how many ranks' data each chunk holds.

    Panel 0 is the input; then one panel per reduce-scatter and all-gather step, with the
    chunk each rank received in that step outlined and labelled with its sender.
    """
    n = world_size
    counts = [[1] * n for _ in range(n)]          # counts[rank][chunk]
    panels = [("input", 0, None, [row[:] for row in counts])]
    for phase, step, sends in ring_schedule(n):
        snapshot = [row[:] for row in counts]     # every rank sends before anyone adds
        for src, dst, chunk in sends:
            if phase == "reduce-scatter":
                counts[dst][chunk] += snapshot[src][chunk]
            else:
                counts[dst][chunk] = snapshot[src][chunk]
        panels.append((phase, step, sends, [row[:] for row in counts]))

    cols = min(len(panels), n)
    rows = math.ceil(len(panels) / cols)
    fig = plt.figure(figsize=(2.4 * cols, 2.3 * rows + 0.6))
    axes = fig.subplots(rows, cols, squeeze=False)
    cmap = ListedColormap(matplotlib.colormaps["Blues"]([0.15 + 0.8 * k / n for k in range(1, n + 1)]))
    norm = BoundaryNorm([k + 0.5 for k in range(n + 1)], cmap.N)
    for ax, (phase, step, sends, grid) in zip(axes.flat, panels):
        ax.imshow(grid, cmap=cmap, norm=norm)
        for r in range(n):
            for c in range(n):
                ax.text(c, r, grid[r][c], ha="center", va="center", fontsize=9,
                        color="white" if grid[r][c] > n / 2 else "black")
        for src, dst, chunk in sends or []:
            ax.add_patch(Rectangle((chunk - 0.5, dst - 0.5), 1, 1, fill=False,
                                   edgecolor="tab:red", linewidth=2))
            ax.text(chunk + 0.45, dst + 0.45, f"\u2190r{src}", ha="right", va="bottom",
                    fontsize=6.5, color="tab:red", bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none"))
        ax.set_title("input" if sends is None else f"{phase} {step}", fontsize=9)
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"Ring all-reduce on {n} ranks\nnumber = how many ranks' data the chunk holds; "
                 f"red = received this step (\u2190 from rank)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_cost_curves(models: dict, world_sizes=(2, 8, 64), alpha: float = 5e-6,
                     beta: float = 1 / 50e9, sizes=None, mark_size: float | None = None, fig=None):
    """Predicted time vs message size (log-log): one colour per N, one line style per model.

    ``models`` maps a name to ``f(size_bytes, world, alpha, beta) -> seconds``, e.g.
    ``{"ring": labkit.comm.ring_all_reduce_time}``. ``fig``: draw into this (empty) Figure
    instead of a new pyplot one (what a widget's draw function does).
    """
    sizes = sizes if sizes is not None else [2.0 ** k for k in range(10, 35)]
    styles = ["-", "--", ":", "-."]
    fig = fig if fig is not None else plt.figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for i, n in enumerate(world_sizes):
        color = f"C{i}"
        for j, (name, model) in enumerate(models.items()):
            ax.plot(sizes, [model(s, n, alpha, beta) for s in sizes], styles[j % 4], color=color,
                    label=f"{name}, N={n}")
    if mark_size is not None:
        ax.axvline(mark_size, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("predicted time (s)")
    ax.set_title(f"\u03b1-\u03b2 model, \u03b1 = {alpha * 1e6:g} \u00b5s, 1/\u03b2 = {1 / beta / 1e9:g} GB/s",
                 fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, ncol=len(world_sizes))
    fig.tight_layout()
    return fig


def plot_bandwidth(sizes_bytes, seconds_by_label: dict, world_size: int, fit=None,
                   kind: str = "all_reduce"):
    """Measured time (left) and bandwidth (right) vs message size, one line per label.

    Algorithm bandwidth is S/t; bus bandwidth scales it by the bytes a rank puts on the
    wire per byte of S (2(N-1)/N for all-reduce), so that it is comparable with a link's
    speed whatever N is. ``fit=(a, b)`` adds the model t = a + b*S (dashed), as returned
    by ``labkit.comm.fit_alpha_beta(sizes_bytes, seconds)``.
    """
    factor = wire_bytes(kind, 1.0, world_size) or 1.0
    fig = plt.figure(figsize=(10, 3.8))
    ax_t, ax_bw = fig.subplots(1, 2)
    for i, (label, seconds) in enumerate(seconds_by_label.items()):
        alg = [s / t / 1e9 for s, t in zip(sizes_bytes, seconds)]
        ax_t.plot(sizes_bytes, seconds, "o-", color=f"C{i}", label=label)
        ax_bw.plot(sizes_bytes, [b * factor for b in alg], "o-", color=f"C{i}", label=f"{label}: bus")
        if factor != 1.0:
            ax_bw.plot(sizes_bytes, alg, "o:", color=f"C{i}", alpha=0.6, label=f"{label}: algorithm")
    if fit is not None:
        a, b = fit
        dense = [min(sizes_bytes) * (max(sizes_bytes) / min(sizes_bytes)) ** (k / 64) for k in range(65)]
        dense = [s for s in dense if a + b * s > 0]  # a poor fit (a < 0) has no time at small S
        model = [a + b * s for s in dense]
        ax_t.plot(dense, model, "k--", linewidth=1, label=f"fit: t = {a * 1e6:.3g} \u00b5s + S \u00d7 {b * 1e9:.3g} ns/B")
        ax_bw.plot(dense, [s / t / 1e9 * factor for s, t in zip(dense, model)], "k--", linewidth=1,
                   label="fit: bus")
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size S (bytes)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_ylabel("time (s)")
    ax_bw.set_ylabel("bandwidth (GB/s)")
    fig.suptitle(f"{kind}, N = {world_size} (bus bandwidth = algorithm bandwidth \u00d7 {factor:.3g})",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_timeline(spans, title: str = "", colors: dict | None = None, lanes: dict | None = None):
    """One row of bars per rank: ``spans`` are ``(rank, start, end, label)`` tuples.

    Bars with the same label share a colour (``colors`` may fix some); rank 0 is on top.
    ``lanes`` maps labels to sub-rows (0 = top, e.g. ``{"all-reduce": 1}``), so work that
    overlaps on one rank (compute and communication streams) is drawn side by side.
    """
    spans = list(spans)
    labels = list(dict.fromkeys(label for _, _, _, label in spans))
    colors = dict(colors or {})
    # Automatic colours skip the ones fixed by the caller, so two labels never share one.
    free = [c for c in (f"C{i}" for i in range(10)) if c not in colors.values()] or ["C0"]
    for i, label in enumerate(l for l in labels if l not in colors):
        colors[label] = free[i % len(free)]
    ranks = sorted({rank for rank, _, _, _ in spans})
    lanes = dict(lanes or {})
    depth = max(lanes.values(), default=0) + 1
    fig = plt.figure(figsize=(8, 0.5 * depth * len(ranks) + 1.4))
    ax = fig.subplots()
    for rank, start, end, label in spans:
        lane = lanes.get(label, 0)
        ax.barh(rank - 0.35 + (lane + 0.5) * 0.7 / depth, end - start, left=start,
                height=0.7 / depth, color=colors[label], edgecolor="black", linewidth=0.5)
    for label in labels:
        ax.barh(0, 0, color=colors[label], label=label)  # empty bar: one legend entry per label
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.6, min(ranks, default=0) - 0.6)
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=10)
    if labels:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- widgets

# Widget callbacks may run on a thread of their own (JupyterLab 4.6 sends widget messages to
# kernel subshells by default, "commsOverSubshells": "perCommTarget"), while the notebook's
# main thread draws too, and matplotlib is not thread-safe: pyplot keeps global state, and
# mathtext's parser and FreeType's glyph cache are shared. Seen in a real browser: tracebacks
# from mathtext inside tight_layout, "FT_Load_Glyph ... invalid outline", blank or distorted
# PNGs. So (1) a widget's figure never touches pyplot (a fresh ``Figure`` per draw), and
# (2) every render in this process, whatever thread it runs on (the inline backend's PNGs,
# savefig, tight_layout, a widget's draw), takes ``DRAW_LOCK``: importing this module wraps
# matplotlib's entry points that lay out and rasterise text (``serialize_rendering``).
DRAW_LOCK = threading.RLock()


def _serialized(method):
    @functools.wraps(method)
    def under_lock(*args, **kwargs):
        with DRAW_LOCK:
            return method(*args, **kwargs)
    under_lock._labkit_serialized = True
    return under_lock


def serialize_rendering() -> None:
    """Make matplotlib's rendering entry points take ``DRAW_LOCK`` (idempotent)."""
    from matplotlib.backend_bases import FigureCanvasBase
    from matplotlib.figure import Figure
    for owner, name in ((FigureCanvasBase, "print_figure"), (FigureCanvasAgg, "draw"),
                        (Figure, "tight_layout"), (Figure, "draw_without_rendering")):
        method = getattr(owner, name)
        if not getattr(method, "_labkit_serialized", False):
            setattr(owner, name, _serialized(method))


serialize_rendering()


def figure_png(fig, dpi: int = 100) -> bytes:
    """PNG bytes of ``fig`` (a ``matplotlib.figure.Figure``), drawn under ``DRAW_LOCK``."""
    buffer = io.BytesIO()
    with DRAW_LOCK:
        FigureCanvasAgg(fig)
        fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def interactive_figure(draw, controls: dict, figsize=(7, 3.5)):
    """A widget: ``controls`` (name -> ipywidgets control) above a figure and a line of text.

    On every change ``draw(fig, **values)`` fills a fresh ``Figure`` (use ``fig.subplots()``,
    never pyplot) and returns a short text (HTML allowed) shown under it. The first draw
    happens here, with the controls' initial values. Returns the ``ipywidgets.VBox``.
    """
    import ipywidgets as widgets
    from matplotlib.figure import Figure

    image = widgets.Image(format="png")
    text = widgets.HTML()

    def update(change=None):
        values = {name: control.value for name, control in controls.items()}
        fig = Figure(figsize=figsize)
        try:
            with DRAW_LOCK:
                text.value = draw(fig, **values) or ""
                image.value = figure_png(fig)
        except Exception:  # noqa: BLE001 - shown where the learner looks, not in a hidden log
            text.value = f"<pre>{html.escape(traceback.format_exc())}</pre>"

    for control in controls.values():
        control.observe(update, names="value")
    update()
    return widgets.VBox([widgets.HBox(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap")),
                         image, text])


# ----------------------------------------------------------------------------- pipelines (chapter 06)

PIPELINE_COLORS = {"F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f"}


def plot_pipeline(spans, title: str = "", fig=None, ax=None, waits=(), peaks=None, time_label: str = "time"):
    """Per-rank timeline of a pipeline schedule, its bubble hatched.

    ``spans`` are ``(rank, start, end, action)`` tuples, e.g. ``labkit.pp.Timeline.spans``;
    ``action`` has ``kind`` ("F", "B" or "W"), ``microbatch`` and ``stage`` (``labkit.pp.Action``).
    Bars are coloured by kind, paler for later chunks of an interleaved rank, and labelled
    with the micro-batch. The idle time of every rank between the first start and the last
    end (the bubble) is hatched; the title gets the idle fraction. ``waits`` are optional
    ``(rank, start, end)`` stretches drawn as thin grey bars (an action blocked in a receive);
    ``peaks`` (one number per rank) is written at the end of each row.

    Draws into ``ax`` if given, else into ``fig`` (a ``matplotlib.figure.Figure``: no pyplot,
    safe in a widget), else into a new pyplot figure. Returns the figure.
    """
    from matplotlib.colors import to_rgb

    spans = list(spans)
    own_axes = ax is None
    if ax is None:
        if fig is None:
            fig = plt.figure(figsize=(9, 0.45 * (1 + max((s[0] for s in spans), default=0)) + 1.4))
        ax = fig.subplots()
    fig = ax.figure
    ranks = 1 + max((rank for rank, *_ in spans), default=0)
    begin = min((start for _, start, _, _ in spans), default=0.0)
    end = max((stop for _, _, stop, _ in spans), default=1.0)
    busy = sum(stop - start for _, start, stop, _ in spans)
    for rank in range(ranks):
        ax.barh(rank, end - begin, left=begin, height=0.8, color="white", edgecolor="0.6",
                hatch="////", linewidth=0.0)
    chunks = 1 + max((getattr(a, "stage", 0) // ranks for *_, a in spans), default=0)
    width = end - begin
    for rank, start, stop, action in spans:
        kind = getattr(action, "kind", str(action)[:1])
        shade = (getattr(action, "stage", 0) // ranks) / max(chunks, 2)
        color = tuple(c + (1 - c) * 0.6 * shade for c in to_rgb(PIPELINE_COLORS.get(kind, "0.5")))
        ax.barh(rank, stop - start, left=start, height=0.8, color=color, edgecolor="white", linewidth=0.6)
        if (stop - start) / width > 0.012 and hasattr(action, "microbatch"):
            ax.text((start + stop) / 2, rank, str(action.microbatch), ha="center", va="center",
                    fontsize=7 if (stop - start) / width > 0.02 else 5, color="white")
    for rank, start, stop in waits:
        ax.barh(rank + 0.3, stop - start, left=start, height=0.18, color="0.55", linewidth=0)
    if peaks is not None:
        for rank, peak in enumerate(peaks):
            ax.text(end + 0.01 * width, rank, f"peak {peak}", va="center", fontsize=7)
    split = any(getattr(a, "kind", "") == "W" for *_, a in spans)
    handles = [Rectangle((0, 0), 1, 1, color=PIPELINE_COLORS[k]) for k in ("FBW" if split else "FB")]
    labels = ["F: forward", "B: backward (input grad.)", "W: weight grad."] if split else ["F: forward", "B: backward"]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="0.6", hatch="////"))
    labels.append("idle (bubble)")
    if waits:
        handles.append(Rectangle((0, 0), 1, 1, color="0.55"))
        labels.append("waiting in a receive")
    ax.legend(handles, labels, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              frameon=False, handlelength=1.2, columnspacing=1.0)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=8)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(begin, end + (0.06 * width if peaks is not None else 0))
    ax.set_xlabel(time_label, fontsize=8)
    idle = 1 - busy / (ranks * width) if spans else 0.0
    ax.set_title(f"{title}{': ' if title else ''}idle {idle:.1%}", fontsize=9, loc="left")
    if own_axes:
        fig.tight_layout()
    return fig
