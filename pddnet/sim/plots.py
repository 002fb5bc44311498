"""PNG plots of a simulation result (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(result: dict[str, Any], out: Path) -> list[Path]:
    """TTFT CDFs per system, RLD queue depth over time, and a cost / goodput bar chart."""
    plt = _plt()
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in result["systems"].items():
        pts = r["ttft_cdf"]
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, simulated)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per system (same workload and seed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out.with_name(out.stem + "-ttft.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    systems = result["systems"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    drawn = False
    for name, r in systems.items():
        q = r["rld"]["queue_depth"]
        if q["max"] and any(q["max"]):
            ax.plot([i * q["interval_s"] for i in range(len(q["max"]))], q["max"], label=name)
            drawn = True
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("requests held by RLD (max per interval)")
    ax.set_title("RLD queue depth")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    fig.tight_layout()
    paths.append(out.with_name(out.stem + "-rld.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(systems)
    ax[0].bar(names, [systems[n]["goodput_rps"] for n in names])
    ax[0].set_ylabel("goodput under SLA (req/s)")
    ax[1].bar(names, [systems[n]["cost_per_hour"] for n in names])
    ax[1].set_ylabel("hardware cost ($/h)")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(out.with_name(out.stem + "-cost.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def plot_frontier(plans: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, p in plans.items():
        xs = [c["cost_per_hour"] for c in p["candidates"]]
        ys = [c["goodput_rps"] for c in p["candidates"]]
        ax.scatter(xs, ys, alpha=0.4, label=f"{name} candidates")
        f = p["frontier"]
        ax.plot(
            [c["cost_per_hour"] for c in f],
            [c["goodput_rps"] for c in f],
            marker="o",
            label=f"{name} frontier",
        )
    ax.set_xlabel("hardware cost ($/h)")
    ax.set_ylabel("goodput under SLA (req/s)")
    ax.set_title("planner: cost vs goodput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
