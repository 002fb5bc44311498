"""reproduce: the source's experiments on the live daemons, at one instance per pool of the
source's deployment and its per-instance load, with the simulator's answer to the same
requests beside every figure.

One command runs, in turn, on emulated accelerators (docs/emulated-devices.md: the small model
computes the tokens, each forward lasts the target model's roofline time on the role's chip,
every time is dilated by one k):

1. the source's agent workload (multi-turn conversations whose prompts grow by appending, to
   64K tokens of context, outputs up to 1K, decode-side hits skewed as the source's) served by
   same-DC PD, naive cross-DC PD and PDD (`pdd bench ttft`'s `run_mode`, one cluster per mode):
   TTFT P50/P90/P99 and the other serving metrics under vLLM's names (docs/benchmarks.md,
   Metrics), RLD's and MD's share of the decode tokens, WAN KV bytes, goodput under the SLA,
   each daemon's overruns;
2. RLD's share on the source's 64K-in / 1K-out shape: PDD's cluster on conversations over one
   shared ~56K-token context, after a warm-up that puts it in MD's cache (the main workload's
   mixed shapes and generous relay pool send most requests to RLD alone);
3. the WAN KV bytes with and without the decode-side cache on long conversations (~90% hit),
   `pdd bench drc`'s two runs, unpaced: bytes do not depend on time;
4. the 100-token handoff, token ids vs KV-direct, quiet and under jitter with competing
   traffic (`pdd bench handoff`'s `source_figure`), on the same chips, k and line;
5. the simulator on the very same requests, chips, line and policy (reproduce_sim.py), with
   the testbed's host time as its host latency: per engine step, from the same-DC run's token
   gaps against its paced decode steps, and per request, measured by a probe of a few idle
   requests on the same-DC cluster before its traffic (not counted in its figures); and on
   the workload's next --spread-seeds draws, how far the TTFT ratios the targets are stated on
   move from draw to draw (reproduce_spread.py).

The workloads are reproduce_workload.py's. The scale is per instance: one P, one RLD, one MD
(one D in same-DC), each on one chip of the source's kind (Qwen2.5-7B's shape, as `pdd sim
reproduce`), conversations arriving at 4x what that scenario offers each of its 40 P instances
(so that a run of minutes reaches its concurrency), and a line as busy under naive cross-DC as
that scenario's (`line_gbit`). The datacenter-scale table stays `pdd sim reproduce`'s. reproduce_table.py turns it all into the
side-by-side table and the checks against the issue's targets; docs/reproduction.md has a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pddnet.bench import metrics
from pddnet.bench.devices import UNPACED, DeviceSetup, print_validity, setup_devices
from pddnet.bench.options import add_run_arguments
from pddnet.bench.plots import cdf_plot
from pddnet.bench.reproduce_sim import (
    DRC_SYSTEMS,
    SYSTEMS,
    host_latency_probe,
    host_step_latency,
    per_step_in_simulator_terms,
    sim_config_dict,
    sim_order,
    simulate_beside,
    with_host_latency,
)
from pddnet.bench.reproduce_spread import SPREAD_SEEDS, spread, spread_plot
from pddnet.bench.reproduce_table import (
    RATIO_TARGETS,
    drc_figures,
    figures,
    markdown,
    order_swaps,
    pipeline_decisions,
    print_report,
    shape_figures,
)
from pddnet.bench.reproduce_workload import (
    SHAPES,
    drc_workload,
    host_probe_workload,
    main_workload,
    shape_workload,
    workload_hits,
)
from pddnet.bench.results import run_config, source_commit, write_result
from pddnet.model.cli import add_model_argument
from pddnet.sim.host_latency import HostLatency, host_latency_from_dict
from pddnet.workload.agent import AgentRequest

MODES = ("same-dc", "cross-dc", "pdd")
DEFAULT_LINE_GBIT = 2.0

# The line's bottleneck buffer, in ms of its rate (a router's; the emulator's default is 1 MiB of
# real bytes, seconds of queue at the few Mbit/s a scaled line runs at on this box)
QUEUE_MS = 20.0
# The handoff figure's real model: tiny-window's attention and context with 8x its KV per token.
# An emulated wire carries the real model's bytes for the target's, so with tiny-window a
# 1500-byte packet stood for 336 KB of qwen2.5-7b's KV and the 20 ms buffer held 16 packets;
# with this one 42 KB and ~120 packets (docs/benchmarks.md, "Segment scale and stripes").
HANDOFF_MODEL = "tiny-window-wide"
# KV pools in blocks of 16 tokens: a full run's hold what the modelled chips hold after the
# weights, at the simulator's memory utilisation (`pool_blocks`), so that the daemons admit,
# refuse and evict as the simulator beside them does; --quick's are small.
QUICK_POOLS = {"prefill": 1024, "relay": 1024, "main_decode": 2048}
MEMORY_UTILISATION = 0.9  # the simulator's default ([engine] memory_utilisation)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny scale for the tests (minutes)")
    add_model_argument(p, default="tiny-window")
    p.add_argument("--target-model", default="qwen2.5-7b", help="model profile to emulate")
    p.add_argument("--prefill-chip", default="h100-sxm", help="P's and same-DC D's chip")
    p.add_argument("--relay-chip", default="h100-sxm", help="the relay pool's chip")
    p.add_argument("--md-chip", default="h200-sxm", help="MD's chip (datacenter B)")
    p.add_argument("--gpus", type=int, default=1, help="chips per instance")
    p.add_argument("--dilation", default="auto", metavar="K|auto", help="time dilation k")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--conversations", type=int, default=4, help="agent conversations")
    p.add_argument("--max-requests", type=int, default=36, help="the first N turns by arrival")
    p.add_argument(
        "--conversation-rate",
        type=float,
        default=None,
        help="new conversations per second (default: 4x one P's share of the scenario's)",
    )
    p.add_argument(
        "--line-gbit",
        type=float,
        default=None,
        help=f"modelled line rate (default: {DEFAULT_LINE_GBIT:g}, 1 with --quick)",
    )
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--jitter-ms", type=float, default=1.0)
    p.add_argument("--wan", default="proxy", choices=("proxy", "packet", "kernel", "auto"))
    p.add_argument(
        "--handoff-wan",
        default="auto",
        choices=("auto", "packet", "proxy"),
        help="the handoff figure's WAN (`pdd bench handoff --wan`); auto: the packet shell "
        "(real TCP through the line's buffer: queueing, tail drops and their recovery) where "
        "root and /dev/net/tun allow, else the proxy",
    )
    p.add_argument(
        "--handoff-model",
        default=HANDOFF_MODEL,
        help=f"the model RLD and MD really run in the handoff figure (default {HANDOFF_MODEL}: "
        "its wire carries 28x fewer bytes than the target's rather than tiny-window's 224x, "
        "so the packet shell's packets and buffer are closer to the target's)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="modelled seconds")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator beside")
    p.add_argument(
        "--spread-seeds",
        type=int,
        default=None,
        help="other draws of the workload the simulator serves, for how far the TTFT ratios "
        f"move from draw to draw (default {SPREAD_SEEDS[1]}, {SPREAD_SEEDS[0]} with --quick; "
        "0: none)",
    )
    p.add_argument("--no-handoff", action="store_true", help="skip the handoff figure")
    p.add_argument(
        "--no-shape", action="store_true", help="skip the 64K-in / 1K-out run (RLD's share)"
    )
    p.add_argument("--no-drc", action="store_true", help="skip the decode-side cache's bytes runs")
    metrics.add_arguments(p)
    # the source scenario's SLA (`pdd sim reproduce`): TTFT 5 s, TPOT 100 ms
    p.set_defaults(goodput=[("ttft", 5000.0), ("tpot", 100.0)])
    add_run_arguments(p, threads="torch threads per daemon")


def line_gbit(args: argparse.Namespace) -> float:
    """The modelled line. Its utilisation, not its rate, is what carries over from the source's
    deployment (as in `pdd sim reproduce`): one P's share of the scenario's 34 Gbit/s line
    (0.85) at this run's load would be overloaded by naive cross-DC's KV (its offered bytes
    are ~1.5x that line, measured in the simulator); 2 Gbit/s keeps it about half busy."""
    if args.line_gbit is not None:
        return args.line_gbit
    return 1.0 if args.quick else DEFAULT_LINE_GBIT


def chips(args: argparse.Namespace) -> dict[str, tuple[str, int]]:
    """Role -> (chip, gpus); `decode` is same-DC's D (datacenter A, P's chip)."""
    return {
        "prefill": (args.prefill_chip, args.gpus),
        "relay": (args.relay_chip, args.gpus),
        "main_decode": (args.md_chip, args.gpus),
        "decode": (args.prefill_chip, args.gpus),
    }


def cluster_settings(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """A mode's cluster config beside the devices: model, line (its buffer too), pools. The
    one source of them: the live clusters run with it (`run_live`, `run_shape`), the probe of
    k and the simulator's config (`simulator_config`) read it."""
    return {
        "mode": mode,
        "model.name": args.model,
        "model.threads": args.threads,
        "wan.shell": args.wan,
        "wan.rtt_ms": args.rtt_ms,
        "wan.jitter_ms": args.jitter_ms,
        "wan.bw_mbit": line_gbit(args) * 1e3,
        "wan.queue_ms": QUEUE_MS,
        **pool_overrides(mode, args),
    }


def pool_overrides(mode: str, args: argparse.Namespace) -> dict[str, int]:
    """`mode`'s KV pools as config overrides (`ROLE.num_blocks`)."""
    if args.quick:
        pools = dict(QUICK_POOLS)
        if mode == "same-dc":  # its decode instance runs as `relay`, holding what MD holds
            pools["relay"] = pools["main_decode"]
    else:
        c = chips(args)
        on = {"prefill": "prefill", "relay": "decode" if mode == "same-dc" else "relay"}
        on["main_decode"] = "main_decode"
        pools = {role: pool_blocks(*c[chip], args.target_model) for role, chip in on.items()}
    return {f"{role}.num_blocks": n for role, n in pools.items()}


def pool_blocks(chip: str, gpus: int, target_model: str) -> int:
    """Blocks of 16 tokens of the target's KV that `gpus` x `chip` hold after its weights, as
    the simulator sizes its pools."""
    from pddnet.device.cost import InstanceCost
    from pddnet.device.profiles import load_chip, load_model

    cost = InstanceCost(load_chip(chip), load_model(target_model), gpus, MEMORY_UTILISATION)
    return cost.kv_capacity_tokens() // 16


def device_flags(mode: str, args: argparse.Namespace, dilation: str) -> argparse.Namespace:
    """The emulated-device flags of `mode`'s cluster: same-DC's D (the `relay` role in that
    mode) is on P's chip in A."""
    c = chips(args)
    roles = {
        "same-dc": (("prefill", "prefill"), ("relay", "decode")),
        "cross-dc": (("prefill", "prefill"), ("main-decode", "main_decode")),
        "pdd": (("prefill", "prefill"), ("relay", "relay"), ("main-decode", "main_decode")),
    }[mode]
    flags = [f"{flag}={c[role][0]}:{c[role][1]}" for flag, role in roles]
    return argparse.Namespace(target_model=args.target_model, device=flags, dilation=dilation)


def devices_per_mode(args: argparse.Namespace) -> dict[str, DeviceSetup]:
    """Every mode's devices at one k (``auto`` probed once, on the cluster with the most roles)."""
    k = args.dilation
    first = "pdd" if "pdd" in args.modes else args.modes[0]
    order = [first] + [m for m in args.modes if m != first]
    out: dict[str, DeviceSetup] = {}
    for mode in order:
        setup = setup_devices(device_flags(mode, args, k), {mode: cluster_settings(mode, args)})
        k = str(setup.dilation)
        out[mode] = setup
    return out


def _ttft_args(args: argparse.Namespace) -> argparse.Namespace:
    """What `ttft.run_mode` reads of its options."""
    return argparse.Namespace(
        model=args.model,
        wan=args.wan,
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        bw_mbit=line_gbit(args) * 1e3,
        threads=args.threads,
        handoff="dynamic",
        request_timeout=args.request_timeout,
    )


async def run_live(
    args: argparse.Namespace,
    phases: dict[str, list[AgentRequest]],
    devices: dict[str, DeviceSetup],
    mode: str,
) -> dict[str, Any]:
    """One mode's cluster on `phases` in turn (`ttft.run_mode`; the figures are the "agent"
    phase's), with this run's settings (`cluster_settings`: pools and line, its buffer too)."""
    from pddnet.bench.ttft import run_mode

    return await run_mode(
        mode,
        phases,
        _ttft_args(args),
        not args.no_progress,
        devices[mode],
        overrides=cluster_settings(mode, args),
    )


def simulator_config(args: argparse.Namespace, slos: dict[str, float]) -> dict[str, Any]:
    """The simulator's config for this run: the engine and policy settings every mode's
    daemons run with, the chips, the line, the SLA."""
    from pddnet.config import load_config

    live = load_config(None, cluster_settings("pdd", args))
    live.target_model = args.target_model
    return sim_config_dict(
        live, chips(args), line_gbit(args), args.rtt_ms, args.jitter_ms, slos, args.seed
    )


def measure_host(
    config: dict[str, Any],
    same: dict[str, Any],
    probe: list[AgentRequest],
    phases: dict[str, list[AgentRequest]],
    requests: list[AgentRequest],
) -> dict[str, Any]:
    """The testbed's host latency for the simulator, from the same-DC run `same` (its records
    by phase and its daemons' stats): the time per engine step (`host_step_latency`), the
    probe's per-request fit beside it (`host_latency_probe`), then the per-step part in the
    simulator's own terms (`per_step_in_simulator_terms`; the measured one is kept as
    ``per_step_measured_ms``)."""
    records = same["records"]["agent"]
    per_step = host_step_latency(records, same["stats"], same["stats_before"].get("agent"))
    answered = [same["records"][name][0] for name in phases]
    host = host_latency_probe(config, probe, answered, per_step)
    fit = host_latency_from_dict(host["fit"])
    step = per_step_in_simulator_terms(with_host_latency(config, fit), requests, records)
    host["per_step_measured_ms"] = per_step * 1e3
    host["fit"] = HostLatency(fit.fixed_s, fit.per_token_s, step).to_dict()
    return host


def probe_phases(probe: list[AgentRequest]) -> dict[str, list[AgentRequest]]:
    """The host probe's requests as phases of one request each, so each is sent alone to an
    idle cluster (`ttft.run_mode` runs phases in turn), before the "agent" phase."""
    return {f"probe{i + 1}": [r] for i, r in enumerate(probe)}


def _async(fn: Callable[..., Any], *a: Any) -> Callable[[], Awaitable[Any]]:
    """``fn(*a)`` in a thread, as a stage (the simulator is CPU work for seconds)."""
    import asyncio

    return lambda: asyncio.to_thread(fn, *a)


async def run_shape(
    args: argparse.Namespace,
    warm: AgentRequest,
    conversations: list[AgentRequest],
    devices: dict[str, DeviceSetup],
) -> dict[str, Any]:
    """PDD's cluster on the 64K-in / 1K-out shape: the warm-up alone (it puts the shared
    context in MD's cache), then the conversations."""
    from pddnet.bench.ttft import run_mode

    return await run_mode(
        "pdd",
        {"warm-up": [warm], "shape": conversations},
        _ttft_args(args),
        not args.no_progress,
        devices["pdd"],
        overrides=cluster_settings("pdd", args),
    )


def simulate_shape(
    config: dict[str, Any], warm: AgentRequest, conversations: list[AgentRequest]
) -> dict[str, Any]:
    """The simulator on the shape as the live cluster sees it: the warm-up alone, then the
    warm-up with the conversations arriving once it has finished. Nothing else is in flight
    while the warm-up runs, so it is served the same in both, and the conversations' RLD
    tokens are the difference (reproduce_table.shape_figures)."""
    alone = simulate_beside(config, [warm], {"pdd": "pdd"})["pdd"]
    start = alone["makespan_s"] + 1e-3
    later = [dataclasses.replace(r, arrival_s=start + r.arrival_s) for r in conversations]
    both = simulate_beside(config, [warm, *later], {"pdd": "pdd"})["pdd"]
    return {"warm_up": alone, "with_conversations": both}


async def run_drc(args: argparse.Namespace, requests: list[AgentRequest]) -> dict[str, Any]:
    """The long conversations twice, MD's cache on then off, every request P->MD (`pdd bench
    drc`'s two runs): unpaced, on a fast line, since the bytes do not depend on time."""
    from pddnet.bench import drc

    pools = pool_overrides("pdd", args)
    fast = argparse.Namespace(
        model=args.model,
        wan=args.wan,
        rtt_ms=args.rtt_ms,
        bw_mbit=1000.0,
        md_blocks=pools["main_decode.num_blocks"],
    )
    more = {**pools, "model.threads": args.threads}
    show = not args.no_progress
    on = await drc.run_variant(fast, requests, "radix", show, UNPACED, more)
    off = await drc.run_variant(fast, requests, "off", show, UNPACED, more)
    return drc.compare(on["records"], off["records"])


def handoff_wan(requested: str) -> str:
    """`--handoff-wan`'s shell: auto takes the packet shell where a testbed can run."""
    if requested != "auto":
        return requested
    from emulation.testbed import unavailable_reason

    return "proxy" if unavailable_reason() is not None else "packet"


def handoff_argv(args: argparse.Namespace, k: float) -> list[str]:
    """`pdd bench handoff` flags for the source's 100-token figure on this run's chips and k,
    RLD and MD holding a prompt of the workload's longest context (64K in a full run), on the
    clusters' line (rate, RTT, jitter, buffer). Its competing traffic is other requests' KV as
    PDD's line carries it (striped over P's wan.stripes bulk lanes, the handoff bench's
    default): transfers of the workload's median new KV per request (what a turn
    adds that MD's cache lacks: ~50 MB of the target's at a full run's shape; every transfer
    of that size or more outlasts a 100-token KV-direct handoff, and the median rather than
    the mean (~6x larger) gives the figure's few seconds more independent busy periods) at
    half the line's rate (the clusters' line is sized to be about half busy). 16 handoffs per
    path and condition: the Poisson traffic needs the time (with 8 the jitter+bulk phase saw
    ~5 transfers, 16% of the line against the 50% offered; 16 cost ~10 s more, the setup's 64K
    prefills dominate). Each cut after a random pause of up to 1 s (modelled): with the
    default 150 ms a disturbed phase lasted ~4 modelled s, ~10 transfers, and the load they
    came to swung from 23% to 60% of the line between runs, and KV-direct's tail with it
    (its max/mean is how many of the handoffs met a transfer); ~50 transfers hold it near
    the offered half. The line is `--handoff-wan`'s, RLD and MD run `--handoff-model`: on the
    packet shell TCP meets the line as real packets, so the byte scale sets how many there are
    (with tiny-window a 100-token KV-direct transfer was 18 packets, one slow-start round, and
    the 20 ms buffer held 16; with the default 140 and ~120, four rounds: the target's 3,900
    packets would take about nine)."""
    import statistics

    from pddnet.device.profiles import load_model as load_profile

    new_tokens = [
        len(r.appended_token_ids if r.turn else r.prompt_token_ids) for r in main_workload(args)
    ]
    bulk_mib = (
        statistics.median(new_tokens) * load_profile(args.target_model).kv_bytes_per_token / 2**20
    )
    argv = [
        *("--model", args.handoff_model, "--target-model", args.target_model),
        *("--device", f"relay={args.relay_chip}:{args.gpus}"),
        *("--device", f"main-decode={args.md_chip}:{args.gpus}"),
        *("--dilation", f"{k:g}", "--rtt-ms", f"{args.rtt_ms:g}"),
        *("--bw-mbit", f"{line_gbit(args) * 1e3:g}", "--queue-ms", f"{QUEUE_MS:g}"),
        *("--jitter-ms", f"{args.jitter_ms:g}", "--bulk-load", "0.5"),
        *("--bulk-mib", f"{bulk_mib:.1f}"),
        *("--threads", str(args.threads), "--seed", str(args.seed), "--out", str(args.out)),
    ]
    argv += ["--wan", handoff_wan(args.handoff_wan)]
    if args.no_progress:
        argv.append("--no-progress")
    if args.quick:
        return [*argv, "--quick"]
    return [
        *argv,
        *("--prompt-len", str(SHAPES["max_context"][1] - 1024)),
        *("--repeats", "16", "--pause-ms", "1000"),
    ]


# Under --dilation auto, a handoff figure whose own devices overran is run once more at this
# much above the k it needed. The probe sizes k for the clusters' forwards; the figure's MD
# runs a 101-token extend over a 64K context in `--handoff-model`, whose real time is closer
# to its modelled one (mean ratio 1.19 at k = 2.1 in session 22's run, against the clusters'
# MD's p95 of 0.68), so one slow moment of the box's is an overrun of 1 in its ~98 forwards.
HANDOFF_RETRY_MARGIN = 1.25


def handoff_retry_k(figure: dict[str, Any], k: float) -> float | None:
    """The k to run the handoff figure at once more (its devices overran at ``k``), or None
    (it kept pace, ran unpaced, or did not run)."""
    if figure.get("valid") is not False:
        return None
    needed = max(k, figure.get("dilation_needed") or k)
    return math.ceil(needed * HANDOFF_RETRY_MARGIN * 10 - 1e-9) / 10


async def handoff_stage(args: argparse.Namespace, k: float) -> dict[str, Any]:
    """The source's handoff figure (`source_figure`) at the clusters' k; under --dilation auto,
    if its own devices overran, once more at `handoff_retry_k` (the figure is then the second
    run's, and the first is kept in its `attempts`). With an explicit k it is never rerun: it
    stays, marked not valid."""
    from pddnet.bench.handoff import source_figure

    figure = await source_figure(handoff_argv(args, k))
    retry = handoff_retry_k(figure, k) if args.dilation == "auto" else None
    if retry is None:
        return figure
    print(
        f"reproduce: the handoff figure's devices overran at k = {k:g} "
        f"({figure['overruns']} of {figure['steps']} forwards): running it again at k = "
        f"{retry:g} (--dilation auto)",
        flush=True,
    )
    again = await source_figure(handoff_argv(args, retry))
    first = {key: figure[key] for key in ("dilation", "valid", "overruns", "steps", "path")}
    return {**again, "attempts": [first]}


def check_args(args: argparse.Namespace) -> None:
    if args.conversations < 1 or args.max_requests < 1 or args.gpus < 1:
        raise ValueError("--conversations, --max-requests and --gpus must be >= 1")
    if args.line_gbit is not None and args.line_gbit <= 0:
        raise ValueError("--line-gbit must be > 0")
    if args.spread_seeds is not None and args.spread_seeds < 0:
        raise ValueError("--spread-seeds must be >= 0")
    if "same-dc" not in args.modes:
        raise ValueError("--modes must include same-dc: every ratio is against it")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    commit = source_commit()  # before anything runs (the tree may change during the run)
    t_start = time.monotonic()
    load_before = os.getloadavg()
    slos = metrics.goodput_config(args)
    requests = main_workload(args)
    warm, shape_requests = shape_workload(args)
    long_requests = drc_workload(args)
    devices = devices_per_mode(args)
    k = devices[args.modes[0]].dilation
    failed: dict[str, str] = {}
    with_shape = not args.no_shape and "pdd" in args.modes

    async def stage(name: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """One stage; a failure is recorded and said, and the other stages' figures are kept."""
        try:
            return await work()
        except Exception as exc:  # noqa: BLE001 - reported in the result, never swallowed
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"reproduce: {name} failed: {failed[name]}", file=sys.stderr)
            return None

    sim_config = sim = sim_shape = sim_drc = host = draws = None
    if args.spread_seeds is None:
        args.spread_seeds = SPREAD_SEEDS[0 if args.quick else 1]
    if not args.no_sim:
        from pddnet.sim.config import parse_config

        sim_config = simulator_config(args, slos)
        parse_config(sim_config)  # a mistake in it shows before the clusters' minutes
    handoff = None
    if not args.no_handoff:
        handoff = await stage("handoff", lambda: handoff_stage(args, k))
    live: dict[str, dict[str, Any]] = {}

    async def live_stage(mode: str, phases: dict[str, list[AgentRequest]]) -> None:
        run_one = await stage(mode, lambda: run_live(args, phases, devices, mode))
        if run_one is not None:
            live[mode] = run_one

    # same-DC first: the host probe runs on its idle cluster before its traffic, and the
    # simulator (seconds, in-process) right after, with the host latency the probe measured
    probe = [] if args.no_sim else host_probe_workload(args, requests)
    phases = probe_phases(probe)
    await live_stage("same-dc", {**phases, "agent": requests})
    if sim_config is not None:
        if "same-dc" in live:
            host = await stage(
                "host probe",
                _async(measure_host, sim_config, live["same-dc"], probe, phases, requests),
            )
        sim_config = with_host_latency(sim_config, host_latency_from_dict((host or {}).get("fit")))
        systems = {m: SYSTEMS[m] for m in args.modes}
        sim = await stage("sim", _async(simulate_beside, sim_config, requests, systems))
        if args.spread_seeds:
            draws = await stage(
                "sim spread",
                _async(spread, sim_config, args, systems, RATIO_TARGETS, main_workload),
            )
        if with_shape:
            sim_shape = await stage(
                "sim shape", _async(simulate_shape, sim_config, warm, shape_requests)
            )
        if not args.no_drc:
            sim_drc = await stage(
                "sim drc", _async(simulate_beside, sim_config, long_requests, DRC_SYSTEMS)
            )
    for mode in args.modes:
        if mode != "same-dc":
            await live_stage(mode, {"agent": requests})
    shape = None
    if with_shape:
        shape = await stage("shape", lambda: run_shape(args, warm, shape_requests, devices))
    drc = None
    if not args.no_drc:
        drc = await stage("drc", lambda: run_drc(args, long_requests))
    wall_s = time.monotonic() - t_start
    result = figures(
        live,
        handoff,
        sim,
        slos,
        wall_s,
        shape=shape_figures(shape, sim_shape, warm, shape_requests),
        drc=drc_figures(drc, sim_drc),
        host=host,
    )
    result["failed_stages"] = failed
    # the line each cluster really ran on, as its emulator reported it (real bytes, wall ms)
    result["lines"] = {"dilation": k, "modes": {m: live[m].get("wan_line") for m in live}}
    result["spread"] = draws
    result["order_swaps"] = {
        m: order_swaps(live[m]["records"]["agent"], requests, sim_rows(sim[m], requests))
        for m in live
        if (sim or {}).get(m)
    }
    if "pdd" in live and (sim or {}).get("pdd"):
        result["pipeline_decisions"] = pipeline_decisions(
            live["pdd"]["records"]["agent"], requests, sim["pdd"]["plan_records"]
        )
    config = run_config(args)
    config.update(
        {
            "line_gbit": line_gbit(args),
            "dilation_k": k,
            "goodput_slos_ms": slos,
            "chips": chips(args),
            "requests": len(requests),
            "conversations": len({r.conversation_id for r in requests}),
            "prefix_hit": workload_hits(requests),
            "shape_requests": len(shape_requests),
            "drc_requests": len(long_requests),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "wall_s": wall_s,
            "commit": commit,
        }
    )
    from pddnet.bench.ttft import request_row

    path = write_result(
        "reproduce",
        {
            "config": config,
            **result,
            "sim_config": sim_config,
            # every request as the simulator served it, in the order of `requests`' lists
            "sim_requests": {m: sim_rows(r, requests) for m, r in (sim or {}).items()},
            "emulation": {m: d.to_dict() for m, d in devices.items()},
            "daemon_stats": {m: live[m]["stats"] for m in live},
            # every request as `pdd bench ttft` keeps it (`pdd trace REQUEST_ID` reads these)
            "requests": {
                **{
                    m: [request_row(r, "agent") for r in run["records"]["agent"]]
                    for m, run in live.items()
                },
                **(
                    {}
                    if shape is None
                    else {
                        f"pdd {name}": [request_row(r, "agent") for r in recs]
                        for name, recs in shape["records"].items()
                    }
                ),
            },
        },
        args.out,
    )
    plots = _plots(live, sim, path, k)
    spread_png = spread_plot(result, path.with_name(f"{path.stem}-spread.png"))
    if spread_png is not None:
        plots.append(str(spread_png))
    table = path.with_name(f"{path.stem}-table.md")
    table.write_text(markdown(result, config, _command_line()))
    plots.append(str(table))
    print_report(result, config, path, plots)
    warnings = print_validity(result["devices"], "reproduce")
    return {"path": str(path), **result, "plots": plots, "warnings": warnings}


def sim_rows(report: dict[str, Any], workload: list[AgentRequest]) -> list[dict[str, Any] | None]:
    """The simulator's `request_records` in workload order (each keeps its rid, its index in
    the simulator's arrival order), beside the live `requests` rows; None: not finished."""
    by_rid = {r["rid"]: r for r in report.get("request_records") or []}
    return [by_rid.get(rid) for rid in sim_order(workload)]


def _command_line() -> str:
    """The command as the user typed it (for the docs' table); from Python, the options."""
    if sys.argv[1:3] == ["bench", "reproduce"]:
        return " ".join(["pdd bench reproduce", *sys.argv[3:]])
    return "pdd bench reproduce (called from Python)"


def _plots(live: dict[str, Any], sim: dict[str, Any] | None, path: Any, k: float) -> list[str]:
    series: dict[str, list[float]] = {}
    for mode, run in live.items():
        series[f"{mode} (live)"] = [
            r.ttft_s for r in run["records"]["agent"] if r.ttft_s is not None
        ]
    for mode, report in (sim or {}).items():
        if mode in live:
            series[f"{mode} (sim)"] = _cdf_samples(report.get("ttft_cdf") or [])
    png = cdf_plot(
        series,
        path.with_name(f"{path.stem}-ttft-cdf.png"),
        f"TTFT (ms, modelled: wall / k = {k:g})",
        "TTFT CDF: live daemons vs the simulator on the same requests",
    )
    return [str(png)] if png else []


def _cdf_samples(points: list[list[float]], n: int = 200) -> list[float]:
    """A CDF's (value, share) points as `n` samples with that distribution (for cdf_plot)."""
    out = []
    j = 0
    for i in range(n):
        q = (i + 0.5) / n
        while j < len(points) - 1 and points[j][1] < q:
            j += 1
        if points:
            out.append(points[j][0])
    return out
