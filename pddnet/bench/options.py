"""The options benchmarks share, declared once: what every benchmark takes (seed, output,
progress, threads), the emulated WAN of the cluster benchmarks and the long-prompt Poisson
workload (`pdd bench ttft` and `pdd demo`)."""

from __future__ import annotations

import argparse


def add_run_arguments(
    p: argparse.ArgumentParser,
    threads: str | None = None,
    out_help: str = "folder for results/<bench>/...",
) -> None:
    """The options every benchmark takes: its seed, where it writes, whether it shows progress;
    with `threads` (that option's help) also the torch threads it runs with."""
    if threads is not None:
        p.add_argument("--threads", type=int, default=1, help=threads)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="results", help=out_help)


def add_wan_arguments(
    p: argparse.ArgumentParser, wan: str, rtt_ms: float = 30.0, shaped: bool = True
) -> None:
    """The emulated WAN of a cluster benchmark's clusters: its shell and round trip; `shaped`:
    also the jitter and the rate (this benchmark and `pdd demo`; the others set their own)."""
    p.add_argument("--rtt-ms", type=float, default=rtt_ms)
    if shaped:
        p.add_argument("--jitter-ms", type=float, default=2.0)
        p.add_argument(
            "--bw-mbit",
            type=float,
            default=None,
            help="WAN rate per direction, in the modelled world when devices are "
            "emulated (default 100; --quick: 4)",
        )
    p.add_argument("--wan", default=wan, choices=("auto", "kernel", "packet", "proxy"))


def add_long_prompt_arguments(
    p: argparse.ArgumentParser,
    requests: int,
    rate: float,
    prompt_len: tuple[int, int],
    max_tokens: tuple[int, int],
) -> None:
    """The long-prompt Poisson workload of a mode (`pdd demo` drives it too); the defaults are
    the benchmark's."""
    p.add_argument("--requests", type=int, default=requests, help="long-prompt requests per mode")
    p.add_argument("--rate", type=float, default=rate, help="Poisson arrivals per second")
    minmax = ("MIN", "MAX")
    p.add_argument("--prompt-len", type=int, nargs=2, default=prompt_len, metavar=minmax)
    p.add_argument("--max-tokens", type=int, nargs=2, default=max_tokens, metavar=minmax)
