"""Simulator configs the tests share: one instance per pool and one unit per token on a
2 Gbit/s line, as `pdd bench reproduce` sets the simulator beside its live cluster."""

from __future__ import annotations


def one_pool_config(requests: int = 1, jitter_ms: float = 0.0, **engine: float) -> dict:
    """The config dict (pddnet.sim.config.parse_config's input); `engine`: [engine] keys."""
    pool = {"instances": 1, "gpus": 1}
    return {
        "model": "qwen2.5-7b",
        "tokens_per_unit": 1,
        "systems": ["same-dc", "cross-dc", "pdd"],
        "chips": {"p": "h100-sxm", "md": "h200-sxm"},
        "pdd": {
            "prefill": {"chip": "p", **pool},
            "relay": {"chip": "p", **pool},
            "main_decode": {"chip": "md", **pool},
        },
        "baseline": {"prefill": {"chip": "p", **pool}, "decode": {"chip": "p", **pool}},
        "line": {"bw_gbit": 2.0, "rtt_ms": 30.0, "jitter_ms": jitter_ms},
        "engine": dict(engine),
        "workload": {"requests": requests},
    }
