"""PNG plots for the benchmarks (matplotlib, Agg backend: no display needed).

Every function takes plain numbers, writes one PNG and returns its path -- or None when
matplotlib is not installed, so a benchmark still writes its JSON and table without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]  # label -> (xs, ys)


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path, tight_bbox: bool = False) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # tight_bbox: the saved image grows to hold what lies outside the axes (a legend below)
    fig.savefig(path, dpi=110, bbox_inches="tight" if tight_bbox else None)
    _pyplot().close(fig)
    return path


def cdf_plot(
    samples: Mapping[str, Sequence[float]],
    path: str | Path,
    xlabel: str,
    title: str,
    scale: float = 1e3,
) -> Path | None:
    """Empirical CDFs, one step line per label; values are multiplied by `scale` (s -> ms)."""
    if not have_matplotlib():
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in samples.items():
        xs = sorted(v * scale for v in values)
        if xs:
            ax.step(
                xs,
                [(i + 1) / len(xs) for i in range(len(xs))],
                where="post",
                label=f"{label} (n={len(xs)})",
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def panels_plot(
    panels: Sequence[tuple[str, Series]],
    path: str | Path,
    xlabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    ncols: int | None = None,
) -> Path | None:
    """Line plots sharing an x axis: one panel per (ylabel, series), side by side (or in rows
    of ``ncols``)."""
    if not have_matplotlib():
        return None
    plt = _pyplot()
    cols = min(ncols or len(panels), len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (ylabel, series) in zip(axes.flat, panels, strict=False):
        for label, (xs, ys) in series.items():
            ax.plot(list(xs), list(ys), marker="o", label=label)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def grouped_bars(
    groups: Mapping[str, Mapping[str, float]], path: str | Path, ylabel: str, title: str
) -> Path | None:
    """One cluster of bars per group (x axis), one bar per label inside it."""
    if not have_matplotlib():
        return None
    plt = _pyplot()
    names = list(groups)
    labels = sorted(
        {k for g in groups.values() for k in g},
        key=lambda k: ([k in g for g in groups.values()].index(True), k),
    )
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(names) * max(len(labels), 1) / 2), 4.2))
    for j, label in enumerate(labels):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        ax.bar(xs, [groups[n].get(label, 0.0) for n in names], width, label=label)
    ax.set_xticks(list(range(len(names))), names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def stacked_bars(
    groups: Mapping[str, Mapping[str, float]],
    path: str | Path,
    ylabel: str,
    title: str,
    colors: Mapping[str, str] | None = None,
    value_fmt: str = "{:.2f}",
    total_fmt: str | None = None,
    notes: Mapping[str, str] | None = None,
    caption: str | None = None,
) -> Path | None:
    """One stacked bar per group (x axis), one segment per label (zero segments are left
    out); each segment annotated with `value_fmt`, each bar's total above it with `total_fmt`
    and its `notes` under its name; the legend right of the axes and the `caption` below
    them, so that neither covers a bar."""
    if not have_matplotlib():
        return None
    plt = _pyplot()
    names = list(groups)
    labels: list[str] = []
    for g in groups.values():
        labels += [k for k, v in g.items() if v and k not in labels]
    fig, ax = plt.subplots(figsize=(max(5.5, (2.4 if notes else 1.9) * len(names)), 4.6))
    bottoms = [0.0] * len(names)
    top = (
        max((sum(float(v or 0.0) for v in g.values()) for g in groups.values()), default=0.0) or 1.0
    )
    for label in labels:
        values = [float(groups[n].get(label, 0.0) or 0.0) for n in names]
        bars = ax.bar(
            range(len(names)),
            values,
            0.6,
            bottom=bottoms,
            label=label,
            color=(colors or {}).get(label),
        )
        for bar, v, b in zip(bars, values, bottoms, strict=True):
            if v > 0.04 * top:  # a thinner segment has no room for its number
                ax.text(
                    bar.get_x() + bar.get_width() / 2,
                    b + v / 2,
                    value_fmt.format(v),
                    ha="center",
                    va="center",
                    fontsize=8,
                )
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    if total_fmt:
        for i, total in enumerate(bottoms):
            ax.text(
                i,
                total + top * 0.015,
                total_fmt.format(total),
                ha="center",
                va="bottom",
                fontsize=9,
            )
    ax.set_ylim(0, top * 1.12)
    ax.set_xticks(
        list(range(len(names))),
        [f"{n}\n{(notes or {}).get(n, '')}".rstrip() for n in names],
        fontsize=8 if notes else None,
    )
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    if labels:  # outside the axes, on the right: it never covers a bar
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if caption:
        import textwrap

        fig.text(0.02, -0.01, textwrap.fill(caption, 110), ha="left", va="top", fontsize=7.5)
    return _save(fig, path, tight_bbox=True)


def strip_plot(
    rows: Sequence[tuple[str, Sequence[float], Mapping[str, float | None], float | None]],
    path: str | Path,
    xlabel: str,
    title: str,
) -> Path | None:
    """One panel per row (label, values, marks, bound): the values as dots spread a little
    vertically so that equal ones stay visible, each mark (label -> value, None: left out) as a
    larger point of its own, the bound as a dashed vertical line."""
    if not have_matplotlib() or not rows:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(7.5, 1.9 * len(rows) + 0.6), squeeze=False)
    for ax, (label, values, marks, bound) in zip(axes.flat, rows, strict=True):
        n = max(len(values), 1)
        ax.scatter(
            list(values),
            [0.3 * ((i * 7919) % n / n - 0.5) for i in range(len(values))],  # fixed spread
            s=22,
            alpha=0.6,
            label=f"draws (n={len(values)})",
        )
        for (name, v), marker in zip(marks.items(), ("D", "s", "^", "v"), strict=False):
            if v is not None:
                ax.scatter([v], [0.0], s=70, marker=marker, zorder=3, label=name)
        if bound is not None:
            ax.axvline(bound, color="k", linestyle="--", linewidth=1, label=f"target {bound:g}")
        ax.set_yticks([])
        ax.set_ylim(-0.5, 0.5)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # off the dots
    fig.suptitle(title, fontsize=11)
    return _save(fig, path, tight_bbox=True)
