"""Figures drawn at build time from the code the kernels use.

Every structural figure calls :mod:`flashattn.schedule` (the same functions the Triton kernels wrap
with ``triton.jit`` and the PyTorch reference loops over), so a change of schedule changes the
pictures. ``python docs/hooks/figures.py OUTDIR`` writes them as SVG files for a look outside MkDocs.
"""

from __future__ import annotations

import io
import math
import os
import sys
from pathlib import Path

import matplotlib
import matplotlib.text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashattn import schedule  # noqa: E402

COLORS = {
    schedule.FULL: "#4c9f70",
    schedule.MASKED: "#f2a541",
    schedule.SKIPPED: "#e6e6e6",
}
LABELS = {
    schedule.FULL: "full: no mask",
    schedule.MASKED: "masked: diagonal or ragged edge",
    schedule.SKIPPED: "skipped: never loaded",
}

plt.rcParams.update(
    {
        "svg.hashsalt": "flashattn",  # stable ids: the same code gives the same file
        "svg.fonttype": "path",
        "font.size": 10,
        "figure.facecolor": "white",  # readable in the dark theme too
        "axes.facecolor": "white",
    }
)


def smallest_font_pt(fig) -> float:
    """The size of the smallest text the figure draws, in points."""
    fig.canvas.draw()
    return min(t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip())


def _svg(fig) -> str:
    # The SVG's user unit is the point (72 per inch): the site's browser test reads the smallest text
    # size from the metadata and the natural width from the file, and works out the size on the page.
    note = f"flashattn-figure: smallest-font-pt={smallest_font_pt(fig):g} dpi=72"
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Description": note})
    plt.close(fig)
    return buf.getvalue()


def _legend(ax, kinds=(schedule.FULL, schedule.MASKED, schedule.SKIPPED), **kw):
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    ax.legend(handles, [LABELS[k] for k in kinds], **kw)


def _grid_axes(ax, n, m, block_m, block_n, title):
    ax.set_xlim(0, m)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    ax.set_xticks(range(0, m + 1, block_n))
    ax.set_yticks(range(0, n + 1, block_m))
    ax.tick_params(labelsize=9)
    ax.set_xlabel("key index j")
    ax.set_ylabel("query index i")
    ax.set_title(title, fontsize=10)


def _draw_schedule(ax, n, m, block_m, block_n, causal, title, window=None):
    if window is None:
        grid = schedule.block_grid(n, m, block_m, block_n, causal)
    else:
        grid = schedule.block_grid(n, m, block_m, block_n, causal, window=window)
    for bi, row in enumerate(grid):
        for bj, kind in enumerate(row):
            sm, sn = bi * block_m, bj * block_n
            h, w = min(block_m, n - sm), min(block_n, m - sn)
            ax.add_patch(Rectangle((sn, sm), w, h, facecolor=COLORS[kind], edgecolor="white", lw=1.5))
    if causal:
        # The causal boundary: query i sees keys j <= i + (M - N).
        i = np.array([0, n])
        ax.plot(i + (m - n) + 1, i, color="black", lw=1.2, ls="--")
    _grid_axes(ax, n, m, block_m, block_n, title)


def causal_schedule() -> str:
    """Which tiles the forward/dQ loop runs with and without a mask, for three shapes."""
    bm = bn = 64
    cases = [
        (384, 384, "N = M = 384"),
        (192, 448, "N = 192 < M = 448 (KV cache)"),
        (448, 256, "N = 448 > M = 256"),
        (300, 300, "N = M = 300 (ragged edge)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(8, 8.4))
    for ax, (n, m, title) in zip(axes.flat, cases):
        grid = schedule.block_grid(n, m, bm, bn, True)
        total = sum(len(r) for r in grid)
        full = sum(r.count(schedule.FULL) for r in grid)
        ran = total - sum(r.count(schedule.SKIPPED) for r in grid)
        _draw_schedule(ax, n, m, bm, bn, True, f"{title}\n{ran}/{total} tiles run, {full} unmasked")
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    fig.suptitle("Causal block schedule (64 × 64 tiles); dashed: the edge of the visible keys")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.legend(handles, [LABELS[k] for k in COLORS], loc="lower center", ncol=2, frameon=False)
    return _svg(fig)


def window_schedule() -> str:
    """Which tiles a sliding window runs, masks and skips, for four shapes and windows."""
    bm = bn = 64
    cases = [  # (N, M, causal, window, title)
        (512, 512, True, (128, None), "N = M = 512, causal, left 128"),
        (512, 512, False, (64, 64), "N = M = 512, window (64, 64)"),
        (192, 576, True, (256, None), "N = 192 < M = 576, causal, left 256"),
        (300, 300, False, (100, 30), "N = M = 300, window (100, 30)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(8, 8.4))
    for ax, (n, m, causal, window, title) in zip(axes.flat, cases):
        grid = schedule.block_grid(n, m, bm, bn, causal, window=window)
        total = sum(len(r) for r in grid)
        full = sum(r.count(schedule.FULL) for r in grid)
        ran = total - sum(r.count(schedule.SKIPPED) for r in grid)
        _draw_schedule(ax, n, m, bm, bn, causal, f"{title}\n{ran}/{total} tiles run, {full} unmasked",
                       window=window)
        # The window's edges: query i sees keys i + (M - N) - left <= j <= i + (M - N) + right.
        i = np.array([0, n])
        left, right = window
        if left is not None:
            ax.plot(i + (m - n) - left, i, color="black", lw=1.2, ls=":")
        if right is not None and not causal:
            ax.plot(i + (m - n) + right + 1, i, color="black", lw=1.2, ls="--")
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    labels = {**LABELS, schedule.MASKED: "masked: a window edge or the ragged edge"}
    fig.suptitle("Sliding-window block schedule (64 × 64 tiles)\ndotted: left edge; dashed: right edge "
                 "(the causal diagonal when causal)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.legend(handles, [labels[k] for k in COLORS], loc="lower center", ncol=2, frameon=False)
    return _svg(fig)


def tiling() -> str:
    """What one program walks: a query block's row (forward, dQ) and a key block's column (dK/dV)."""
    n = m = 512
    bm = bn = 64
    fig, grid = plt.subplots(2, 2, figsize=(8, 8.4))
    axes = [grid[0][0], grid[0][1], grid[1][0]]
    grid[1][1].axis("off")

    # Forward: one program per query block, walking along its row of key blocks.
    qb = 5
    sm = qb * bm
    full_end, hi = schedule.forward_key_range(sm, bm, bn, n, m, True)
    ax = axes[0]
    _draw_schedule(ax, n, m, bm, bn, True, f"forward / dQ: program of query block {qb}\n"
                   f"keys < {full_end} unmasked, < {hi} masked, ≥ {hi} skipped")
    ax.add_patch(Rectangle((0, sm), m, bm, fill=False, edgecolor="black", lw=2))
    ax.add_patch(FancyArrowPatch((8, sm + bm / 2), (max(hi - 8, 16), sm + bm / 2), arrowstyle="-|>",
                                 mutation_scale=14, color="black", lw=1.5))

    # dK/dV: one program per key block, walking down its column of query blocks.
    kb = 2
    sn = kb * bn
    lo, full_start, full_end_q = schedule.backward_query_range(sn, bm, bn, n, m, True)
    ax = axes[1]
    _grid_axes(ax, n, m, bm, bn, f"dK / dV: program of key block {kb}\n"
               f"rows < {lo} skipped, < {full_start} masked, < {full_end_q} unmasked")
    for start in range(0, n, bm):
        if start < lo:
            kind = schedule.SKIPPED
        elif start < full_start or start >= full_end_q:
            kind = schedule.MASKED
        else:
            kind = schedule.FULL
        ax.add_patch(Rectangle((sn, start), bn, min(bm, n - start), facecolor=COLORS[kind],
                               edgecolor="white", lw=1.5))
    ax.plot([1, n + 1], [0, n], color="black", lw=1.2, ls="--")
    ax.add_patch(Rectangle((sn, 0), bn, n, fill=False, edgecolor="black", lw=2))
    ax.add_patch(FancyArrowPatch((sn + bn / 2, lo + 8), (sn + bn / 2, n - 8), arrowstyle="-|>",
                                 mutation_scale=14, color="black", lw=1.5))

    # Ragged shapes: the last query block of N = 300 only has 300 - 256 rows.
    n2, m2 = 300, 300
    _draw_schedule(axes[2], n2, m2, bm, bn, False, "non-causal, N = M = 300:\nragged edge only")
    fig.tight_layout(w_pad=3)
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    grid[1][1].legend(handles, [LABELS[k] for k in COLORS], loc="center", frameon=False)
    return _svg(fig)


def pointer_offsets() -> str:
    """How a block of row-major memory is addressed: offsets, a transposed load, a moving block."""
    rows, d = 8, 4
    stride_row, stride_d = d, 1  # a contiguous (rows, d) matrix
    block = 3
    offs_d = np.arange(d)

    fig = plt.figure(figsize=(8, 8.8))
    panels = fig.subplot_mosaic([["a", "c"], ["b", "b"]], height_ratios=[1.6, 1])
    axes = [panels["a"], panels["b"], panels["c"]]

    # Panel 1: the whole matrix with the address of each element; a block of rows highlighted.
    ax = axes[0]
    start = 2
    offs_m = start + np.arange(block)
    ptrs = offs_m[:, None] * stride_row + offs_d[None, :] * stride_d  # [block, d]
    addr = np.arange(rows)[:, None] * stride_row + offs_d[None, :] * stride_d
    ax.imshow(np.isin(addr, ptrs).astype(float), cmap=ListedColormap(["#f4f4f4", "#8ab6d6"]), vmin=0, vmax=1)
    for r in range(rows):
        for c in range(d):
            ax.text(c, r, str(addr[r, c]), ha="center", va="center", fontsize=9)
    ax.set_xticks(range(d))
    ax.set_yticks(range(rows))
    ax.set_xlabel("column (d)")
    ax.set_ylabel("row")
    ax.set_title("Q rows 2..4:\noffs_m[:, None]*stride + offs_d[None, :]", fontsize=9)

    # Panel 2: the transposed load of K: rows of the tile are d, columns are keys.
    ax = axes[1]
    offs_n = 1 + np.arange(5)
    ptrs_t = offs_d[:, None] * stride_d + offs_n[None, :] * stride_row  # [d, block_n]
    ax.imshow(np.zeros_like(ptrs_t, dtype=float), cmap=ListedColormap(["#fbe3c0"]))
    for r in range(ptrs_t.shape[0]):
        for c in range(ptrs_t.shape[1]):
            ax.text(c, r, str(ptrs_t[r, c]), ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(offs_n)), [str(j) for j in offs_n])
    ax.set_yticks(range(d))
    ax.set_xlabel("key j")
    ax.set_ylabel("d")
    ax.set_title("Kᵀ tile, keys 1..5: offs_d[:, None] + offs_n[None, :]*stride", fontsize=9)

    # Panel 3: moving the block: add block_n * stride to every pointer.
    ax = axes[2]
    ax.set_xlim(-0.5, d - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    for k, color in enumerate(["#8ab6d6", "#b7d7a8", "#f6c6c6"]):
        s = k * block
        for r in range(s, min(s + block, rows)):
            for c in range(d):
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor=color, edgecolor="white"))
                ax.text(c, r, str(r * stride_row + c), ha="center", va="center", fontsize=9)
        ax.text(d - 0.4, s + 0.2, f"step {k}", fontsize=9, va="center")
    ax.add_patch(Rectangle((-0.5, rows - 0.5), d, 1, facecolor="none", edgecolor="red", ls=":"))
    ax.set_xticks(range(d))
    ax.set_yticks(range(rows))
    ax.set_title("moving block: ptrs += BLOCK * stride\n(rows past the end need a mask)", fontsize=9)
    ax.set_aspect("equal")
    fig.tight_layout()
    return _svg(fig)


def masking() -> str:
    """Element masks near the diagonal and the ragged edge, and what a 0-scored padding key does."""
    n, m, bm, bn = 10, 13, 4, 4
    n_pad, m_pad = -(-n // bm) * bm, -(-m // bn) * bn
    kinds = np.zeros((n_pad, m_pad))
    for i in range(n_pad):
        for j in range(m_pad):
            if i >= n or j >= m:
                kinds[i, j] = 2  # out of range: padding rows/columns of a ragged tile
            elif not schedule.is_visible(i, j, n, m, True):
                kinds[i, j] = 1  # in range, hidden by the causal mask
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 9.4), gridspec_kw={"height_ratios": [1.3, 1]})
    ax = axes[0]
    cmap = ListedColormap(["#4c9f70", "#f2a541", "#c7c7c7"])
    ax.imshow(kinds, cmap=cmap, vmin=0, vmax=2, extent=(0, m_pad, n_pad, 0))
    for x in range(0, m_pad + 1, bn):
        ax.axvline(x, color="white", lw=2)
    for y in range(0, n_pad + 1, bm):
        ax.axhline(y, color="white", lw=2)
    ax.axvline(m, color="black", lw=1, ls=":")
    ax.axhline(n, color="black", lw=1, ls=":")
    ax.set_xticks(range(0, m_pad + 1, bn))
    ax.set_yticks(range(0, n_pad + 1, bm))
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.set_title(f"N = {n}, M = {m}, causal, 4 × 4 tiles", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in ("#4c9f70", "#f2a541", "#c7c7c7")]
    ax.legend(handles, ["visible", "causal: set to −∞", "out of range: keys −∞, rows not stored"],
              loc="upper left", bbox_to_anchor=(0, -0.1), ncol=2, fontsize=9, frameon=False)

    # One row whose real scores are all negative (base 2), and four padding keys.
    ax = axes[1]
    s = np.array([-3.0, -2.5, -4.0, -3.2])
    pad = 4
    right = np.exp2(s - s.max()) / np.exp2(s - s.max()).sum()
    s0 = np.concatenate([s, np.zeros(pad)])  # padding scored 0 instead of -inf
    wrong = np.exp2(s0 - s0.max()) / np.exp2(s0 - s0.max()).sum()
    x = np.arange(len(s0))
    ax.bar(x[: len(s)] - 0.2, right, width=0.4, color="#4c9f70", label="padding = −∞ (right)")
    ax.bar(x - 0.2 + 0.4, wrong, width=0.4, color="#d1495b", label="padding = 0 (wrong)")
    ax.axvline(len(s) - 0.5, color="black", ls=":", lw=1)
    ax.set_xticks(x, [f"k{j}" for j in range(len(s))] + ["pad"] * pad)
    ax.set_ylabel("softmax weight")
    ax.set_title("A row with negative scores: padded 0 becomes the max", fontsize=10)
    ax.legend(fontsize=9, frameon=False)
    fig.tight_layout()
    return _svg(fig)


def dataflow() -> str:
    """The loop bodies of the forward and the two backward kernels, drawn from the dataflow models of
    :mod:`derivations.cost_model`, whose product counts that module checks against the ``tl.dot`` calls
    of the kernels' source. Left: what is read from HBM; middle: the per-tile steps (products numbered
    in kernel order); right: what is written back."""
    from derivations import cost_model as cm

    kernels = [*cm.FORWARD, *cm.BACKWARD_TWO_KERNELS]
    products = cm.kernel_products()
    names = ["forward", "dK, dV", "dQ"]
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 12))
    number = 0
    for ax, kernel, name in zip(axes, kernels, names):
        if name == "dK, dV":
            number = 0  # the backward's seven products are numbered 1–7 across its two kernels
        ax.set_xlim(0, 10)
        steps = list(kernel.body)
        ax.set_ylim(-len(steps) - 1.5, 1.2)
        ax.axis("off")
        ax.set_title(f"{name} kernel: {len(products[name])} tl.dot per tile in the source", fontsize=10)
        ax.add_patch(Rectangle((0.1, -len(steps) - 0.5), 2.2, len(steps) + 1.2, color="#dde6f5"))
        ax.text(1.2, 0.45, "HBM reads", ha="center", fontsize=9, weight="bold")
        for r, t in enumerate(kernel.loads):
            ax.text(1.2, -0.3 - r * 0.75, t, ha="center", va="center", fontsize=9)
        ax.add_patch(Rectangle((2.8, -len(steps) - 0.5), 4.4, len(steps) + 1.2, color="#f3efe0"))
        ax.text(5.0, 0.45, "on chip, per tile (fp32)", ha="center", fontsize=9, weight="bold")
        for r, step in enumerate(steps):
            y = -0.3 - r
            if isinstance(step, cm.MatMul):
                number += 1
                op = "+=" if step.accumulate else "="
                label = f"({number}) {step.out} {op} {step.a}·{step.b}"
                color = "#4c9f70"
            else:
                label = f"{step.out} ← f({', '.join(step.inputs)})"
                color = "#888888"
            ax.text(3.0, y, label, va="center", fontsize=9, color=color,
                    weight="bold" if isinstance(step, cm.MatMul) else "normal")
        ax.add_patch(Rectangle((7.7, -len(steps) - 0.5), 2.2, len(steps) + 1.2, color="#dde6f5"))
        ax.text(8.8, 0.45, "HBM writes", ha="center", fontsize=9, weight="bold")
        for r, t in enumerate(kernel.outputs):
            ax.text(8.8, -0.3 - r * 0.75, t, ha="center", va="center", fontsize=9)
        for x0, x1 in ((2.3, 2.8), (7.2, 7.7)):
            ax.add_patch(FancyArrowPatch((x0, -len(steps) / 2), (x1, -len(steps) / 2), arrowstyle="->",
                                         mutation_scale=12))
    fig.tight_layout()
    return _svg(fig)


def online_rescaling() -> str:
    """One row of scores folded in four key blocks by the base-2 online softmax of
    :mod:`derivations.online_softmax`: the running max m, the rescale factor α = 2^(m_old − m_new) and
    the pivot-free sum l·2^m after each block, against the full row's Σ 2^s."""
    from derivations.online_softmax import online_step

    rng = np.random.default_rng(3)
    scores = np.round(rng.normal(0, 2.5, 32) + np.linspace(-3, 4, 32), 2)
    block = 8
    state = (-np.inf, 0.0, [0.0])
    ms, alphas, pivot_free = [], [], []
    for start in range(0, len(scores), block):
        sc = list(scores[start:start + block])
        m_old = state[0]
        m_new = max([m_old, *sc])
        state = online_step(state, sc, [[0.0]] * len(sc), m_new, lambda x: 2.0 ** x)
        ms.append(m_new)
        alphas.append(2.0 ** (m_old - m_new))
        pivot_free.append(state[1] * 2.0 ** state[0])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 6.8))
    ax1.bar(range(len(scores)), scores, color=["#9db4d9" if (k // block) % 2 else "#4c72b0" for k in range(len(scores))])
    low = float(scores.min()) - 1.0
    for b, m in enumerate(ms):
        ax1.hlines(m, b * block - 0.5, b * block + block - 0.5, colors="#c44e52", linewidth=2,
                   label="running max m" if b == 0 else None)
        ax1.text(b * block + block / 2 - 0.5, low, f"α = {alphas[b]:.2g}", fontsize=9, ha="center",
                 color="#c44e52")
    ax1.set_ylim(low - 1.0, float(scores.max()) + 1.0)
    ax1.legend(fontsize=9, frameon=False, loc="upper left")
    ax1.set_xlabel("key j (blocks of 8)")
    ax1.set_ylabel("base-2 score s_j")
    ax1.set_title("Running max: α rescales the old state when m grows", fontsize=10)
    total = float(np.sum(2.0 ** scores))
    ax2.plot(range(len(ms)), pivot_free, "o-", color="#4c72b0", label="ℓ · 2^m after each block")
    ax2.axhline(total, color="#c44e52", linestyle="--", label="Σ_j 2^(s_j), whole row")
    ax2.set_xticks(range(len(ms)))
    ax2.set_xlabel("blocks folded in")
    ax2.set_yscale("log")
    ax2.set_title("The pivot-free sum only grows, and ends exact", fontsize=10)
    ax2.legend(fontsize=9, frameon=False)
    fig.tight_layout()
    return _svg(fig)


def packing() -> str:
    """Programs of one head of a varlen forward launch, mapped to sequences by schedule.packed_programs."""
    lengths = [70, 0, 150, 20, 95]  # one empty sequence
    block = 32
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    programs = schedule.packed_programs(cu, cu, block)
    palette = ["#4c9f70", "#f2a541", "#5b8bd0", "#c4577a", "#8e6cc0"]
    fig, ax = plt.subplots(figsize=(8.3, 3.6))
    total = cu[-1]
    # top row: the packed query rows, coloured by sequence
    for s, n in enumerate(lengths):
        if n:
            ax.add_patch(Rectangle((cu[s], 2.2), n, 0.8, facecolor=palette[s], edgecolor="white", lw=1.5))
            ax.text(cu[s] + n / 2, 2.6, f"seq {s}: {n} rows", ha="center", va="center", fontsize=9)
    ax.text(cu[2], 3.15, "seq 1: 0 rows (no tile)", ha="center", fontsize=9, color="#555555")
    # bottom row: one box per program, at the rows its tile covers; spare programs greyed at the end
    spare = 0
    for pid, work in enumerate(programs):
        if work is None:
            x = total + 12 + spare * 22
            ax.add_patch(Rectangle((x, 0.2), 18, 0.8, facecolor=COLORS[schedule.SKIPPED], edgecolor="#999999", lw=0.8))
            ax.text(x + 9, 0.6, f"p{pid}", ha="center", va="center", fontsize=9, color="#777777")
            spare += 1
            continue
        seq, start, q_start, _, n, _ = work
        x, w = q_start + start, min(block, n - start)
        ax.add_patch(Rectangle((x, 0.2), w, 0.8, facecolor=palette[seq], alpha=0.55, edgecolor="black", lw=0.8))
        ax.text(x + w / 2, 0.6, f"p{pid}", ha="center", va="center", fontsize=9)
        ax.add_patch(FancyArrowPatch((x + w / 2, 1.05), (x + w / 2, 2.15), arrowstyle="-|>", mutation_scale=7,
                                     color="#777777", lw=0.6))
    ax.text(total + 12 + spare * 11, 1.25, "spare programs: stop at once", ha="center", fontsize=9, color="#555555")
    ax.set_xlim(-5, total + 12 + spare * 22 + 10)
    ax.set_ylim(0, 3.5)
    ax.set_yticks([0.6, 2.6], ["programs\n(one head)", "packed rows"])
    ax.set_xlabel("packed row index (cu_seqlens = " + ", ".join(map(str, cu)) + ")")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    working = sum(p is not None for p in programs)
    ax.set_title(f"BLOCK_M = {block}: {len(programs)} programs = cdiv({total}, {block}) + {len(lengths)} sequences;\n"
                 f"{working} take a tile, {len(programs) - working} are spare", fontsize=10)
    return _svg(fig)


def dkdv_schedule(steps: int = 3) -> list[tuple]:
    """The Gluon dK/dV kernel's partitions on one SM, as a list schedule of the operations of
    :mod:`flashattn.hopper.bwd`'s step in their program order, with its ring depth (``STAGES``) and
    its ``OVERLAP`` switch read from the module: (name, unit, owner, step, issued, start, finish) per
    operation, where ``issued`` is when its inputs were ready (a product waits after that for the
    tensor cores, which take products in the order they were issued). Durations are units, not
    measurements: at D = 128 the four products of a step have the same size (64 x 64 x 128
    multiply-adds), so they get one unit each; the exponentials and dS^T get less, a TMA tile load 0.8."""
    from flashattn.hopper import bwd as hb

    mma, exp_t, ds_t, load_t = 1.0, 0.6, 0.4, 0.8
    ops = []  # (name, unit, duration, deps, owner, step)

    def op(name, unit, duration, deps, owner, step):
        ops.append((name, unit, duration, tuple(deps), owner, step))
        return len(ops) - 1

    loads = []
    for t in range(steps):  # the producer's ring: tile t waits until both consumers finished step t - STAGES
        loads.append(op("Q, dO", "tma", load_t, [loads[-1]] if loads else [], "producer", t))
    done = {0: None, 1: None}
    release = []  # per step: the last op of each consumer
    for t in range(steps):
        ends = []
        for c in (0, 1):
            prev = [done[c]] if done[c] is not None else []
            s_op = op("Sᵀ", "tc", mma, [loads[t], *prev], c, t)
            dp_op = op("dPᵀ", "tc", mma, [loads[t], *prev], c, t)  # issued right behind Sᵀ
            p_op = op("Pᵀ", f"alu{c}", exp_t, [s_op], c, t)
            if hb.OVERLAP:
                dv_op = op("dV", "tc", mma, [p_op], c, t)  # issued behind dP^T, before dS^T
                ds_op = op("dSᵀ", f"alu{c}", ds_t, [p_op, dp_op], c, t)
            else:
                ds_op = op("dSᵀ", f"alu{c}", ds_t, [p_op, dp_op], c, t)
                dv_op = op("dV", "tc", mma, [ds_op], c, t)
            dk_op = op("dK", "tc", mma, [ds_op, dv_op], c, t)
            done[c] = dk_op
            ends.append(dk_op)
        release.append(ends)
    # a ring slot is free again once both consumers finished the step that used it
    ops = [(n, u, d, deps + (tuple(release[s - hb.STAGES]) if n == "Q, dO" and s >= hb.STAGES else ()), o, s)
           for n, u, d, deps, o, s in ops]
    # Each unit takes its operations in the order they became ready (issued, for the tensor cores),
    # ties in program order: consumer 0's before consumer 1's.
    start, finish, free = {}, {}, {}
    while len(start) < len(ops):
        ready = [(max([0.0, *(finish[j] for j in deps)]), i) for i, (n, u, d, deps, o, s) in enumerate(ops)
                 if i not in start and all(j in finish for j in deps)]
        t_ready, i = min(ready)
        start[i] = max(free.get(ops[i][1], 0.0), t_ready)
        finish[i] = free[ops[i][1]] = start[i] + ops[i][2]
    return [(n, u, o, s, max([0.0, *(finish[j] for j in deps)]), start[i], finish[i])
            for i, (n, u, d, deps, o, s) in enumerate(ops)]


def warpgroup_timeline() -> str:
    """:func:`dkdv_schedule` drawn as one row per partition and one for the tensor cores."""
    from flashattn.hopper import bwd as hb

    steps = 3
    schedule_ = dkdv_schedule(steps)
    rows = {"tma": 3, "alu0": 2, "tc": 1, "alu1": 0}
    names = {"tma": "producer warp: TMA loads", "alu0": "consumer 0: exp2, dSᵀ",
             "tc": "tensor cores (wgmma)", "alu1": "consumer 1: exp2, dSᵀ"}
    colors = {"producer": "#9bb7d4", 0: "#4c9f70", 1: "#f2a541"}
    # The run is cut in two halves drawn one above the other, so that a short operation is wide
    # enough for its label at the width of the page.
    end = max(t1 for *_, t1 in schedule_) + 0.2
    fig, axes = plt.subplots(2, 1, figsize=(8.3, 6.4))
    for ax, (lo, hi) in zip(axes, ((0, end / 2), (end / 2, end))):
        for n, u, o, s, _, t0, t1 in schedule_:
            y = rows[u]
            ax.add_patch(Rectangle((t0, y + 0.12), t1 - t0, 0.76, facecolor=colors[o], edgecolor="white"))
            mid = (t0 + t1) / 2
            if lo <= mid < hi:
                ax.text(mid, y + 0.5, f"{n}{s}", ha="center", va="center", fontsize=9,
                        rotation=0 if t1 - t0 > 0.9 else 90)
        ax.set_yticks([r + 0.5 for r in rows.values()], [names[u] for u in rows])
        ax.set_ylim(0, 4)
        ax.set_xlim(lo, hi)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel("time (units: one wgmma of a 64 x 64 x 128 product)")
    axes[0].set_title(f"dK/dV kernel, {steps} query blocks per consumer (STAGES = {hb.STAGES}, "
                      f"OVERLAP = {hb.OVERLAP}):\ngreen consumer 0, orange consumer 1; the run continues below",
                      fontsize=10)
    fig.tight_layout()
    return _svg(fig)


def persistent_walk() -> str:
    """Key blocks per CTA when 132 persistent CTAs walk the forward's query blocks in the kernel's
    order (flashattn.hopper.fwd.walk_work): statically without a mask and with the causal one, and
    dynamically with the causal one (the default there), every key block taking the same time."""
    from flashattn.hopper.fwd import section_default, walk_work

    heads, n, ctas = 16, 16384, 132
    section = section_default(heads, n, ctas)
    panels = ((False, False, "no mask, static"), (True, False, "causal, static"),
              (True, True, f"causal, dynamic (sections of {section} head{'s' if section > 1 else ''})"))
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 8.4), sharey=True)
    for ax, (causal, dynamic, label) in zip(axes, panels):
        work = walk_work(heads, n, n, ctas, causal, dynamic=dynamic, section=section)
        mean = sum(work) / len(work)
        ax.bar(range(ctas), work, width=1.0, color=COLORS[schedule.MASKED if causal else schedule.FULL])
        ax.axhline(mean, color="black", linewidth=1, linestyle="--")
        ax.text(ctas - 1, mean, f"mean {mean:.0f}", ha="right", va="bottom", fontsize=9)
        ax.set_title(f"{label}: busiest CTA {max(work)}, {max(work) / mean:.2f} x the mean", fontsize=10)
        ax.set_xlabel("CTA (one per SM)")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    for ax in axes:
        ax.set_ylabel("key blocks walked")
    fig.suptitle(f"Persistent walks of the forward's query blocks: B x H = {heads}, N = M = {n},\n"
                 f"128 x 128 tiles, {ctas} CTAs; static: blocks p, p + {ctas}, ...;\ndynamic: the next block "
                 f"to the CTA free first", fontsize=10)
    fig.tight_layout()
    return _svg(fig)


# Where the committed short-shapes run lives (FLASHATTN_BENCH_RESULTS moves it, as for the Benchmarks page).
SHORT_JSON = Path(os.environ.get("FLASHATTN_BENCH_RESULTS", ROOT / "benchmarks" / "results")) / "short" / "short.json"


def short_training(result: dict) -> str:
    """Speed over the fastest SDPA backend at each short training shape (a ``benchmarks.short`` run):
    flashattn and FlexAttention, forward and forward + backward, one row per shape."""
    from benchmarks import short

    rows = short.ratios(result["rows"])
    shapes = list(dict.fromkeys((short.shape_label(r), r["causal"]) for r in rows))
    issue = {(short.shape_label({"batch": b, "heads": h, "seqlen": n, "head_dim": d, "dtype": dt}), c)
             for b, h, n, d, dt, c in short.ISSUE_SHAPES}
    fig, axes = plt.subplots(1, 2, figsize=(8, 1.8 + 0.26 * len(shapes)), sharey=True)
    y = {shape: i for i, shape in enumerate(shapes)}
    series = (("flashattn_us", "#1f77b4", "o", "flashattn"), ("flex_us", "#d62728", "^", "FlexAttention"))
    xs = [1.0]
    for ax, p in zip(axes, short.PASSES):
        mine = [r for r in rows if r["pass"] == p and r["best_sdpa_us"]]
        for key, color, marker, label in series:
            pts = [(r["best_sdpa_us"] / r[key], y[short.shape_label(r), r["causal"]]) for r in mine if r[key]]
            xs += [x for x, _ in pts]
            ax.scatter([x for x, _ in pts], [v for _, v in pts], color=color, marker=marker, s=28, label=label,
                       zorder=3)
        ax.axvline(1.0, color="black", lw=1, ls="--")
        ax.set_title(short.PASS_LABELS[p], fontsize=10)
        ax.tick_params(labelsize=9)
    ticks = [2.0 ** k for k in range(-8, 9) if min(xs) / 1.6 <= 2.0 ** k <= max(xs) * 1.6]
    ticks = ticks if len(ticks) <= 5 else [t for t in ticks if round(math.log2(t)) % 2 == 0]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
        ax.set_xticks(ticks, [f"{t:g}×" if t >= 0.25 else f"1/{1 / t:g}×" for t in ticks])
        ax.minorticks_off()
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(shapes)))
    axes[0].set_yticklabels([f"{label}{' causal' if causal else ''}" for label, causal in shapes])
    for tick, shape in zip(axes[0].get_yticklabels(), shapes):
        tick.set_fontweight("bold" if shape in issue else "normal")
    axes[0].set_ylim(len(shapes) - 0.5, -0.5)
    fig.supxlabel("speed over the fastest SDPA backend at the shape (right of the dashed line: faster)",
                  fontsize=10, y=0.04)
    fig.suptitle(f"Short training shapes, eager calls, {result['device']}\n"
                 "(bold: the four shapes of issue 45)", fontsize=10)
    handles = [plt.Line2D([], [], color=c, marker=m, ls="", label=lab) for _, c, m, lab in series]
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    return _svg(fig)


def short_training_committed() -> str:
    import json

    return short_training(json.loads(SHORT_JSON.read_text(encoding="utf-8")))


FIGURES = {
    "packing": packing,
    "dataflow": dataflow,
    "online-rescaling": online_rescaling,
    "causal-schedule": causal_schedule,
    "window-schedule": window_schedule,
    "tiling": tiling,
    "pointer-offsets": pointer_offsets,
    "masking": masking,
    "warpgroup-timeline": warpgroup_timeline,
    "persistent-walk": persistent_walk,
}
if SHORT_JSON.is_file():  # drawn from the committed run, once there is one
    FIGURES["short-training"] = short_training_committed


def render_all():
    for name, draw in FIGURES.items():
        yield name, draw()


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "figures")
    out.mkdir(parents=True, exist_ok=True)
    for name, svg in render_all():
        (out / f"{name}.svg").write_text(svg, encoding="utf-8")
        print(out / f"{name}.svg")
