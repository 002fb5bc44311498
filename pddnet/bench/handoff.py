"""handoff: KV-direct handoff vs token-id handoff + Extend-Decode, for 10..200 relay tokens, on a
quiet emulated WAN and under jitter with competing bulk traffic.

When MD's copy of a request's prompt KV is complete, RLD has made `n` tokens (the relay tokens)
that MD lacks. Two ways to hand them over, run side by side in one run on the same engines,
wire format and emulated link:

- token-id (pddnet's handoff, DESIGN point 3): RLD sends one HANDOFF frame with the token ids
  (P's first token and the n relay tokens, as the daemons' RLD sends them) on its control lane;
  MD appends them to its held sequence and releases it (the engine calls
  MD's daemon makes, `edit_sequence`), and ONE extend forward digests P's first token and the n
  relay tokens and samples MD's first token.
- KV-direct (the baseline, added here as a handoff transport for this purpose): RLD exports the
  KV of those tokens from its blocks (`export_kv`, positions [prompt, prompt + n)) and sends it
  as KV_CHUNK frames (`payload_from_tensor`) on a bulk lane, plus the same HANDOFF for the ids;
  MD reserves blocks (`Engine.reserve_kv`, which finds the prompt in MD's prefix cache, so only
  those n positions are missing), imports every chunk as it lands (`import_kv`) and runs one
  ordinary decode step to sample its first token (RLD never computed its last token's KV).

Handoff latency = from the moment RLD decides the cut to the moment MD has sampled its first
token: "MD can sample the next token", made concrete by including in both paths the one forward
that yields those logits (the extend for token-id, a one-token decode for KV-direct). It is
split into wire time (cut -> the last byte MD needs has been decoded) and MD time (the rest:
extend, or the last imports + decode). Both ends live in this process, so one clock times them.
Each is summarised under vLLM's stat-key names (mean_/median_/std_/p90_/p99_/max_ +
handoff_latency, wire, md, forward, import + _ms; pddnet.bench.metrics.stats_ms).

This runs at benchmark level, not inside the daemons (their own handoff is token-id only), but
on the same parts they use: the daemons' handoff machines (RLD's `RelayHandoff` cuts when MD's
`MainHandoff` asks with TAKEOVER; MD's applies the HANDOFF and emits from the cut), a real
`Engine` per side (torch threads as --threads), the `pddnet.protocol` codec, authenticated
`pddnet.transport` connections (`dial` / `Server`) and the proxy-shell WAN emulator (`pdd wan
proxy`, its own process) between RLD and MD, changed at run time through its control API
(`emulation.control`). Competing traffic is a bounded bulk sender: other requests' KV
(KV_CHUNK frames of ~--bulk-mib) arriving as a Poisson process with an offered load of
--bulk-load of the link's rate, striped over --bulk-stripes bulk lanes as P stripes its KV to
MD, through the same link. The files:
handoff_setup.py (per prompt), handoff_sides.py (RLD's and MD's sides), handoff_rig.py (the
link, the lanes, the traffic; one handoff, one condition), handoff_summary.py (figures, table,
plots); this one the options and the run.

Setup (not timed): per prompt, a colocated reference `Engine.generate` (the oracle), a P engine
(prefill only) whose prompt KV is imported into RLD and MD, and one RLD decode run of the longest
relay count; a cut at n sends RLD's first n tokens and their KV (causal: exactly what RLD had
after n tokens). RLD and MD each have one engine for the whole run, built as their daemons build
theirs (handoff_setup.engine_for: MD's prefix cache is the radix tree) and kept warm, as the
daemons' long-lived engines are. (A fresh engine per handoff, with the hash cache MD's daemon
does not use, made MD's forward at a 64K-token prompt index the cold prompt in ~27 ms of
Python against the radix tree's ~7 ms: 3-4x the forward itself.) Each handoff still starts MD
from the same state: empty, then the prompt's KV imported as a cold copy (nothing of it cached,
so MD's first forward indexes the prompt in its prefix cache, as the daemon's does), and ends by
freeing all it allocated and evicting the cache (handoff_sides.MainTrial). Every handoff checks
that MD's next two tokens are the reference's (token-exact) and the result records it.

With emulated devices (--target-model, --device relay=CHIP[:GPUS] --device main-decode=...,
--dilation K|auto; handoff_devices.py) RLD's decode and MD's sampling forward are paced to the
target model's time on their chips x k, the link and the competing traffic are the modelled
line's as this box runs them (rate x real / target KV bytes per token / k, delay, jitter and
pauses x k; handoff_rig.py), every reported time is wall / k, the payload is given in the
target's bytes beside the real ones, and the JSON's `devices` says how well the box kept up (a
run that overran on more than 1% of its forwards ends with a NOT VALID banner). The defaults
then model the source's line (10 Gbit/s) and other requests' KV of ~800 llama-3-70b tokens.

`source_figure` runs just the source's figure (100 relay tokens, quiet and jitter+bulk, the
latter also with the control lane in a priority class; both paths) and returns its summary (handoff_summary.figure): what `pdd bench reproduce` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pddnet.bench.devices import print_validity
from pddnet.bench.handoff_devices import setup_handoff_devices
from pddnet.bench.handoff_rig import (
    CONDITIONS,
    DEFAULT_MTU,
    DEFAULT_TCP_CC,
    WAN_SHELLS,
    Rig,
    handoff_once,
    make_wan,
    run_condition,
    tcp_congestion_controls,
)
from pddnet.bench.handoff_setup import (
    BLOCK_SIZE,
    KV_DIRECT,
    PATHS,
    TOKEN_ID,
    Prepared,
    engine_for,
    make_prompts,
    prepare_prompt,
    relay_tokens_needed,
)
from pddnet.bench.handoff_summary import figure, headline, plot, print_table, summarise
from pddnet.bench.options import add_run_arguments
from pddnet.bench.progress import progress
from pddnet.bench.results import announce, run_config, write_result
from pddnet.config import WanSection
from pddnet.device import flags as device_flags

# -- options --------------------------------------------------------------------------------------

# The options --quick and the emulated devices change: None in the parser, so that one given
# wins; otherwise the first table that has it: the emulated line's (with --target-model), then
# --quick's, then DEFAULTS (apply_defaults).
DEFAULTS: dict[str, Any] = {
    "model": "small",
    "relay_tokens": [10, 25, 50, 100, 200],
    "repeats": 16,
    "prompts": 2,
    "prompt_len": 256,
    "chunk_tokens": 64,
    "rtt_ms": 30.0,
    "bw_mbit": 100.0,
    "bulk_mib": 2.0,
    "pause_ms": 150.0,
}
QUICK: dict[str, Any] = {
    "model": "tiny",
    "relay_tokens": [10, 40],
    "repeats": 3,
    "prompts": 1,
    "prompt_len": 64,
    "chunk_tokens": 16,
    "rtt_ms": 10.0,
    "bw_mbit": 20.0,
    "bulk_mib": 0.25,
    "pause_ms": 40.0,
}
# modelled with a target model: the source's 10 Gbit/s line; bulk transfers of other requests'
# KV (256 MiB: ~800 tokens of llama-3-70b; 32 MiB with --quick)
EMULATED: dict[str, Any] = {"bw_mbit": 10000.0, "bulk_mib": 256.0}
QUICK_EMULATED: dict[str, Any] = {"bw_mbit": 10000.0, "bulk_mib": 32.0}


# the competing traffic's lanes: P's KV stripes to MD (pddnet.config's wan.stripes)
DEFAULT_BULK_STRIPES = WanSection().stripes


def _defaults_help(name: str) -> str:
    said = [f"default {DEFAULTS[name]}"]
    for label, table in (("--quick", QUICK), ("with --target-model", EMULATED)):
        if name in table:
            said.append(f"{label} {table[name]}")
    return "; ".join(said)


# The line and its competing traffic in the conditions: flag, default (None: see DEFAULTS), help;
# in the modelled world when devices are emulated
_LINK_OPTIONS: tuple[tuple[str, float | None, str], ...] = (
    ("--rtt-ms", None, "round trip"),
    ("--bw-mbit", None, "bottleneck rate per direction"),
    ("--queue-ms", 10.0, "bottleneck buffer, in ms of the link rate"),
    ("--jitter-ms", 5.0, "jitter (normal, std) in the jitter conditions"),
    ("--bulk-load", 0.5, "competing traffic's offered load, as a share of the link rate"),
    ("--bulk-mib", None, "mean size of a bulk transfer (the target model's bytes when emulated)"),
    ("--pause-ms", None, "random pause (0..this) before each cut, to sample the bulk traffic"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, two relay counts, 3 handoffs each (smoke test); options given win",
    )
    p.add_argument("--model", default=None, help=f"model preset ({_defaults_help('model')})")
    p.add_argument(
        "--relay-tokens",
        type=int,
        nargs="+",
        default=None,
        help=f"relay token counts to hand over ({_defaults_help('relay_tokens')})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"handoffs per count, path, condition ({_defaults_help('repeats')})",
    )
    p.add_argument(
        "--conditions", nargs="+", default=["quiet", "jitter+bulk"], choices=list(CONDITIONS)
    )
    p.add_argument(
        "--wan",
        default="proxy",
        choices=WAN_SHELLS,
        help="the emulated WAN: proxy (loopback, lossless: a full buffer holds the sender "
        "back) or packet (TUN devices between namespaces, real TCP, tail drop; needs root)",
    )
    p.add_argument(
        "--mtu",
        type=int,
        default=None,
        help=f"with --wan packet: the link's MTU (default {DEFAULT_MTU})",
    )
    p.add_argument(
        "--tcp-cc",
        default=None,
        help=f"with --wan packet: the congestion control of RLD's and MD's sockets (default "
        f"{DEFAULT_TCP_CC}; one this kernel offers)",
    )
    p.add_argument(
        "--bulk-stripes",
        type=int,
        default=DEFAULT_BULK_STRIPES,
        help="TCP connections the competing traffic is striped over, as P stripes its KV to MD "
        f"(default {DEFAULT_BULK_STRIPES}: wan.stripes' default)",
    )
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help=f"prompt tokens, a multiple of {BLOCK_SIZE} ({_defaults_help('prompt_len')})",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"distinct prompts, used in turn ({_defaults_help('prompts')})",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy; seeded otherwise")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help=f"KV-direct: tokens per KV_CHUNK frame, as wan.chunk_tokens "
        f"({_defaults_help('chunk_tokens')})",
    )
    for flag, default, help_text in _LINK_OPTIONS:
        name = flag[2:].replace("-", "_")
        said = f"{help_text} ({_defaults_help(name)})" if default is None else help_text
        p.add_argument(flag, type=float, default=default, help=said)
    add_run_arguments(p, threads="torch threads")
    device_flags.add_arguments(p)


def apply_defaults(args: argparse.Namespace) -> None:
    """Fill the options left unset: the emulated line's (with --target-model), then --quick's,
    then DEFAULTS."""
    tables = []
    if getattr(args, "target_model", None) is not None:
        tables.append(QUICK_EMULATED if args.quick else EMULATED)
    if args.quick:
        tables.append(QUICK)
    tables.append(DEFAULTS)
    for name in DEFAULTS:
        if getattr(args, name, None) is None:
            setattr(args, name, next(t[name] for t in tables if name in t))


def check_args(args: argparse.Namespace) -> None:
    if not args.relay_tokens or min(args.relay_tokens) < 1:
        raise ValueError("--relay-tokens must list counts >= 1")
    if args.prompt_len < BLOCK_SIZE or args.prompt_len % BLOCK_SIZE:
        raise ValueError(
            f"--prompt-len must be a positive multiple of {BLOCK_SIZE} (MD's "
            f"prefix cache then holds the whole prompt), got {args.prompt_len}"
        )
    for name in ("repeats", "prompts", "chunk_tokens", "threads", "bulk_stripes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("rtt_ms", "queue_ms", "jitter_ms", "pause_ms", "temperature"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.bw_mbit <= 0 or args.bulk_mib <= 0:
        raise ValueError("--bw-mbit and --bulk-mib must be > 0")
    if not 0 < args.bulk_load < 1:
        raise ValueError(f"--bulk-load must be in (0, 1), got {args.bulk_load}")
    if len(set(args.conditions)) != len(args.conditions):
        raise ValueError("--conditions lists a condition twice")
    if args.mtu is not None:
        if args.wan != "packet":
            raise ValueError("--mtu needs --wan packet (the proxy carries bytes, not packets)")
        if not 576 <= args.mtu <= 65535:
            raise ValueError(
                f"--mtu must be in 576..65535 (IPv4's smallest datagram), got {args.mtu}"
            )
    if args.tcp_cc is not None:
        if args.wan != "packet":
            raise ValueError("--tcp-cc needs --wan packet (the proxy's TCP runs on loopback)")
        offered = tcp_congestion_controls()
        if args.tcp_cc not in offered:
            raise ValueError(
                f"--tcp-cc {args.tcp_cc!r} is not offered by this kernel "
                f"(it has: {', '.join(offered)})"
            )


# -- entry point ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_defaults(args)
    check_args(args)
    devices = setup_handoff_devices(args)  # before anything starts (--dilation auto: a probe)
    import torch

    from pddnet.engine.sampling import SamplingParams
    from pddnet.model.loader import load_model

    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    model, tok = load_model(args.model)
    config = model.config
    from pddnet.kv.pool import KVSpec

    spec = KVSpec.from_model_config(config, BLOCK_SIZE)
    n_max = max(args.relay_tokens)
    if args.prompt_len + n_max + 3 > config.max_position:
        raise ValueError(
            f"--prompt-len + the largest relay count exceed the model's "
            f"max_position {config.max_position}"
        )
    loop = asyncio.get_running_loop()
    rld_ex = ThreadPoolExecutor(1, thread_name_prefix="handoff-rld")
    md_ex = ThreadPoolExecutor(1, thread_name_prefix="handoff-md")
    preps: list[Prepared] = []
    trials: list[dict[str, Any]] = []
    infos: dict[str, Any] = {}
    # RLD's and MD's engines, warm for the whole run as their daemons' are: RLD holds every
    # prompt's sequence; MD one trial's at a time (the prompt, then what a cut adds)
    rld_engine = engine_for(
        model, tok, "relay", *[relay_tokens_needed(args.prompt_len, n_max)] * args.prompts
    )
    md_engine = engine_for(model, tok, "main_decode", args.prompt_len + 2 * n_max + 8)
    rig = Rig(md_engine, md_ex, rld_ex, devices)
    try:
        prompts = make_prompts(
            args.prompts, args.prompt_len, config.vocab_size, config.bos_token_id, args.seed
        )
        rld_pacer = devices.pacer("relay")
        for i, prompt in enumerate(prompts):
            sp = SamplingParams(temperature=args.temperature, seed=args.seed * 1000 + i)
            preps.append(
                await loop.run_in_executor(
                    rld_ex, prepare_prompt, model, tok, i, prompt, n_max, sp, rld_engine, rld_pacer
                )
            )
        await rig.start(args)
        for kind in PATHS:  # warm-up (torch, lanes, proxy), not recorded
            await handoff_once(rig, kind, f"warm-{kind}", preps[0], min(args.relay_tokens), 0.0)
        # The setup (64K-token prompts as lists, their reference outputs, two engines) lives
        # for the whole run; every gen-2 collection scanned it and paused this process, RLD's
        # and MD's paced forwards with it, for 55-280 ms (five such pauses per run: overruns
        # of the modelled devices made by the bench's own heap). Freeze it out of the
        # collector, as servers do after start-up; what the trials allocate is still collected.
        gc.collect()
        gc.freeze()
        total = len(args.conditions) * args.repeats * len(args.relay_tokens) * len(PATHS)
        with progress(total, "handoff", unit="handoff", enabled=not args.no_progress) as bar:
            for ci, name in enumerate(args.conditions):
                got = await run_condition(rig, args, ci, name, preps, bar, spec)
                trials += got["trials"]
                infos[name] = got["info"]
        assert rig.wan is not None
        wan_info = rig.wan.describe()
        unexpected = list(rig.main.unexpected) if rig.main else []
    finally:
        gc.unfreeze()
        await rig.close()
        rld_ex.shutdown(wait=True)
        md_ex.shutdown(wait=True)
        rld_engine.close()
        md_engine.close()
    rows = summarise(trials, args.conditions, args.relay_tokens)
    head = headline(rows)
    report = devices.report()
    # what carried it: the line, the model RLD and MD really ran, the competing traffic's lanes
    fig = {
        **figure(head, report),
        "wan": wan_info,
        "model": args.model,
        "bulk_stripes": args.bulk_stripes,
    }
    cfg = run_config(args)
    cfg["dilation_k"] = devices.k
    consistency = {
        "all_token_exact": all(t["token_exact"] for t in trials),
        "token_id_payload_below_kv_direct": all(
            r[TOKEN_ID]["payload_bytes"] < r[KV_DIRECT]["payload_bytes"]
            for cond_rows in rows.values()
            for r in cond_rows
        ),
        "kv_bytes_received_match": all(
            t["kv_bytes_received"]
            == (t["relay_tokens"] * spec.bytes_per_token if t["path"] == KV_DIRECT else 0)
            for t in trials
        ),
        "token_id_extends_in_one_forward": all(
            t["forward_tokens"] == t["relay_tokens"] + 1 for t in trials if t["path"] == TOKEN_ID
        ),
        "kv_direct_forward_is_one_token": all(
            t["forward_tokens"] == 1 for t in trials if t["path"] == KV_DIRECT
        ),
        # paced: MD's sampling forward lasted at least its modelled time (wall / k)
        "forwards_last_their_modelled_time": all(
            t["forward_s"] >= t["forward_modelled_s"] - 1e-6
            for t in trials
            if t["forward_modelled_s"] is not None
        ),
        "unexpected_frames": unexpected[:5],
    }
    path = write_result(
        "handoff",
        {
            "config": cfg,
            "threads_per_daemon": args.threads,
            "kv_bytes_per_token": spec.bytes_per_token,
            "model_dtype": config.dtype,
            "emulation": devices.setup.to_dict(),
            "devices": report,
            "link": {
                **wan_info,
                "initial": make_wan(args, devices.setup).initial_effects,
                "jitter_ms": args.jitter_ms * devices.k,
                "modelled": {
                    "rtt_ms": args.rtt_ms,
                    "bw_mbit": args.bw_mbit,
                    "queue_ms": args.queue_ms,
                    "jitter_ms": args.jitter_ms,
                },
            },
            "conditions": {c: {"rows": rows[c], **infos[c]} for c in args.conditions},
            "headline": head,
            "figure": fig,
            "consistency": consistency,
            "prompts": [
                {
                    "index": p.index,
                    "prompt_tokens": len(p.prompt),
                    "relay_token_exact": p.relay == p.reference[: len(p.relay)],
                }
                for p in preps
            ],
            "elapsed_s": time.monotonic() - t_start,
            "trials": trials,
        },
        args.out,
    )
    pngs = plot(args, rows, trials, head, path)
    print_table(args, rows, head, spec.bytes_per_token, infos, devices.setup.line(), wan_info)
    announce(path, pngs)
    warnings = print_validity({"": report}, "handoff")
    return {
        "path": str(path),
        "rows": rows,
        "headline": head,
        "figure": fig,
        "devices": report,
        "consistency": consistency,
        "plots": pngs,
        "warnings": warnings,
    }


# The source's figure: 100 relay tokens, quiet and under jitter with competing traffic, on a
# plain FIFO line and on one that serves the control lane first
SOURCE_FIGURE_ARGV = (
    "--relay-tokens",
    "100",
    "--conditions",
    "quiet",
    "jitter+bulk",
    "jitter+bulk+priority",
)


async def source_figure(argv: Sequence[str] = ()) -> dict[str, Any]:
    """Run just the source's 100-token handoff figure, both paths, and return its summary
    (`handoff_summary.figure`, with the result JSON's `path`). `argv`: more `pdd bench handoff`
    flags (--target-model, --device, --dilation, --repeats, --quick, --out, ...)."""
    p = argparse.ArgumentParser(prog="pdd bench handoff")
    add_arguments(p)
    result = await run(p.parse_args([*SOURCE_FIGURE_ARGV, *argv]))
    return {**result["figure"], "path": result["path"]}
