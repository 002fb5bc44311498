"""The calibration's output: quantiles, the CDF and decode-fit figure, table formatting."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def quantiles(values: list[float]) -> dict[str, float | None]:
    from pddnet.bench.results import summary

    return summary(values)


def plot(
    path: Path,
    real_ttft: list[float],
    real_itl: list[float],
    sim: Any,
    fit: dict[str, Any],
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for ax, name, real, hist, scale, unit in (
        (axes[0], "TTFT", real_ttft, sim.ttft, 1.0, "s"),
        (axes[1], "ITL", real_itl, sim.itl, 1e3, "ms"),
    ):
        xs = sorted(real)
        ax.plot(
            [x * scale for x in xs],
            [(i + 1) / len(xs) for i in range(len(xs))],
            label="testbed",
            lw=2,
        )
        pts = hist.cdf_points(400)
        ax.plot([v * scale for v, _ in pts], [f for _, f in pts], label="simulator", lw=2, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        if name == "ITL":  # below 1 ms: tokens the router coalesced into one SSE chunk
            ax.set_xlim(left=1.0)
        ax.set_xlabel(f"{name} ({unit})")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{name}: testbed vs simulator")
    ax = axes[2]
    for role, mk in (("relay", "o"), ("main_decode", "s")):
        f = fit["decode"][role]
        bb = sorted(int(k) for k, v in f["by_batch"].items() if v["n"] >= 10)
        ax.plot(bb, [f["by_batch"][str(k)]["mean_s"] * 1e3 for k in bb], mk, label=f"{role} mean")
        ax.plot(
            bb,
            [f["by_batch"][str(k)]["median_s"] * 1e3 for k in bb],
            mk,
            mfc="none",
            label=f"{role} median",
        )
        line = [
            (
                f["a_s"]
                + f["b_s_per_seq"] * k
                + f["c_s_per_ctx"] * f["by_batch"][str(k)]["mean_context"]
            )
            * 1e3
            for k in bb
        ]
        base = (
            ", P idle, no outside load"
            if f.get("p_idle_only") and fit.get("load_floor") is not None
            else ", P idle"
            if f.get("p_idle_only")
            else ""
        )
        ax.plot(bb, line, "-", alpha=0.6, label=f"{role} fit (at its mean context{base})")
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("inter-token gap (ms)")
    idle = any(fit["decode"][r].get("p_idle_only") for r in ("relay", "main_decode"))
    ax.set_title("fit run: decode step vs batch" + (" (gaps while P idle)" if idle else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt_err(err: float | None) -> str:
    return "-" if err is None else f"{err:+.0%}"


def fmt_ratio(c: dict[str, Any]) -> str:
    if not c["gaps"]:
        return "-"
    return (
        f"x{c['mean_ratio']:.2f} (median x{c['median_ratio']:.2f}, cv {c['cv']:.2f}, "
        f"{c['gaps']} gaps)"
    )
