"""A request's timeline as a Chrome / Perfetto trace: P, RLD, MD and the WAN on one time axis.

Input is the `pdd` object of a completion (its `timeline`: `{event, time, producer, detail}`
milestones from every daemon, `time.time()` of one box, so one clock). Each request becomes one
trace "process" with a track ("thread") per party:

    router   the request, arrival -> done
    P        prefill (prefill_start -> prefill_end)
    RLD      relay decode (rld_kv_complete -> its last token / the cut), the handoff
    WAN      MD's KV copy crossing (prefill_start -> md_kv_complete), the HANDOFF messages
    MD       extend + decode (handoff_end, or md_kv_complete without a relay -> request_done)
    client   tokens received (a counter), when the client's token arrival times are given

plus every milestone as an instant on its producer's track, with its detail as args. Open the
file in https://ui.perfetto.dev or chrome://tracing. Spans are derived from milestones, so a
span whose end milestone is missing (a cancelled request) is left out, never guessed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

TRACKS = ("router", "P", "RLD", "WAN", "MD", "client")
_TID = {name: i + 1 for i, name in enumerate(TRACKS)}
_TRACK_OF_PRODUCER = {"router": "router", "prefill": "P", "relay": "RLD", "main_decode": "MD"}


def _events_by_name(timeline: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """First occurrence of each milestone (the timeline is sorted by time)."""
    out: dict[str, Mapping[str, Any]] = {}
    for e in timeline:
        out.setdefault(e["event"], e)
    return out


def _check(pdd: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    if not isinstance(pdd, Mapping):
        raise ValueError(f"expected a completion's `pdd` object (a dict), got {type(pdd).__name__}")
    timeline = pdd.get("timeline")
    if not isinstance(timeline, list) or not timeline:
        raise ValueError(f"request {pdd.get('request_id')!r}: its `pdd` object has no timeline")
    for i, e in enumerate(timeline):
        if not isinstance(e, Mapping) or not {"event", "time", "producer"} <= set(e):
            raise ValueError(
                f"request {pdd.get('request_id')!r}: timeline entry {i} lacks "
                f"event/time/producer: {e!r}"
            )
    return sorted(timeline, key=lambda e: e["time"])


_ROUTER_ARGS = ("mode", "pipeline", "ttft_s")
_HANDOFF_ARGS = ("handoff_bytes",)


def _spans(
    pdd: Mapping[str, Any], ev: Mapping[str, Mapping[str, Any]], last_relay_token_at: float | None
) -> Iterator[tuple[str, str, float, float, dict]]:
    """(track, name, start, end, args) of the phases the milestones delimit."""

    def t(name: str) -> float | None:
        e = ev.get(name)
        return None if e is None else float(e["time"])

    done_by = ev.get("request_done", {}).get("producer")
    wan_end = t("md_kv_complete")
    handoff_start, handoff_end = t("handoff_start"), t("handoff_end")
    rld_end = last_relay_token_at
    if rld_end is None:
        rld_end = (
            handoff_end
            if handoff_end is not None
            else (t("request_done") if done_by == "relay" else None)
        )
    md_start = (
        handoff_end if handoff_end is not None else (wan_end if pdd.get("main_tokens") else None)
    )
    md_end = t("request_done") if done_by == "main_decode" else None
    md_name = "extend + decode" if handoff_end is not None else "decode"
    # (track, name, start, end, the `pdd` fields shown as the span's args)
    rows = (
        ("router", f"request ({pdd.get('finish_reason')})", t("arrival"), t("done"), _ROUTER_ARGS),
        ("P", "prefill", t("prefill_start"), t("prefill_end"), ()),
        ("WAN", "KV copy to MD", t("prefill_start"), wan_end, ("wan_kv_bytes",)),
        ("RLD", "relay decode", t("rld_kv_complete"), rld_end, ("relay_tokens",)),
        ("RLD", f"handoff ({pdd.get('handoff_mode')})", handoff_start, handoff_end, _HANDOFF_ARGS),
        ("WAN", "token-id handoff", handoff_start, handoff_end, _HANDOFF_ARGS),
        ("MD", md_name, md_start, md_end, ("main_tokens",)),
    )
    for track, name, start, end, fields in rows:
        if start is not None and end is not None and end >= start:
            yield track, name, start, end, {k: pdd.get(k) for k in fields}


def request_trace_events(
    pdd: Mapping[str, Any], pid: int, origin: float, token_times: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """Trace events of one request (process `pid`); times in µs after `origin` (seconds)."""
    timeline = _check(pdd)
    ev = _events_by_name(timeline)
    rid = str(pdd.get("request_id", f"request {pid}"))
    # on emulated devices the modelled world's time: wall seconds / k (pddnet.device.dilation)
    k = float((pdd.get("emulation") or {}).get("dilation", 1.0))

    def us(t: float) -> float:
        return round((t - origin) / k * 1e6, 3)

    out: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": pid,
            "args": {"name": f"{rid} [{pdd.get('mode')}, {pdd.get('pipeline')}]"},
        },
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}},
    ]
    used = {"router", "P", "RLD", "WAN", "MD"} | ({"client"} if token_times else set())
    relay_name = "D (decode in A)" if pdd.get("mode") == "same-dc" else "RLD"
    for track in TRACKS:
        if track in used:
            out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": _TID[track],
                    "args": {"name": relay_name if track == "RLD" else track},
                }
            )
            out.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": _TID[track],
                    "args": {"sort_index": _TID[track]},
                }
            )
    relay_tokens = int(pdd.get("relay_tokens") or 0)
    last_relay = (
        token_times[relay_tokens - 1]
        if token_times and 0 < relay_tokens <= len(token_times)
        else None
    )
    for track, name, start, end, args in _spans(pdd, ev, last_relay):
        out.append(
            {
                "ph": "X",
                "name": name,
                "cat": track,
                "pid": pid,
                "tid": _TID[track],
                "ts": us(start),
                "dur": round((end - start) / k * 1e6, 3),
                "args": args,
            }
        )
    for e in timeline:
        track = _TRACK_OF_PRODUCER.get(str(e["producer"]), "router")
        out.append(
            {
                "ph": "i",
                "s": "t",
                "name": e["event"],
                "cat": "milestone",
                "pid": pid,
                "tid": _TID[track],
                "ts": us(float(e["time"])),
                "args": {"detail": e.get("detail"), "producer": e["producer"]},
            }
        )
    for i, t in enumerate(token_times or ()):
        out.append(
            {
                "ph": "C",
                "name": "tokens received",
                "pid": pid,
                "tid": _TID["client"],
                "ts": us(t),
                "args": {"tokens": i + 1},
            }
        )
    return out


def chrome_trace(
    requests: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    token_times: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """A trace document for one `pdd` object or several (one trace process each), on one
    clock whose zero is the earliest milestone; `token_times` maps request_id -> the client's
    token arrival times (`time.time()`), shown as the client track."""
    pdds = [requests] if isinstance(requests, Mapping) else list(requests)
    if not pdds:
        raise ValueError("no requests to trace")
    timelines = [_check(p) for p in pdds]
    origin = min(float(tl[0]["time"]) for tl in timelines)
    events: list[dict[str, Any]] = []
    for pid, pdd in enumerate(pdds, start=1):
        times = (token_times or {}).get(str(pdd.get("request_id")))
        events += request_trace_events(pdd, pid, origin, times)
    emulations = {json.dumps(p["emulation"], sort_keys=True) for p in pdds if p.get("emulation")}
    clock = "time.time() of the box every daemon runs on"
    if emulations:
        clock += "; on emulated devices, divided by each request's dilation k"
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "origin_unix_s": origin,
            "requests": len(pdds),
            "clock": clock,
            "emulation": [json.loads(e) for e in sorted(emulations)],
        },
    }


def write_trace(
    path: str | Path,
    requests: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    token_times: Mapping[str, Sequence[float]] | None = None,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(requests, token_times)))
    return path


def find_pdd_objects(data: Any, request_id: str) -> list[dict[str, Any]]:
    """Every `pdd` object (a dict with `request_id` and `timeline`) for `request_id` inside a
    JSON document: a completion body, a benchmark result, a list of either."""
    found: list[dict[str, Any]] = []
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if x.get("request_id") == request_id and isinstance(x.get("timeline"), list):
                found.append(x)
                continue
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return found


def find_token_times(data: Any, request_id: str) -> list[float] | None:
    """The client's token arrival times that a benchmark stored beside a request's `pdd`
    object (a dict holding `pdd` and `token_times`), if any."""
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            pdd = x.get("pdd")
            if isinstance(pdd, dict) and pdd.get("request_id") == request_id:
                times = x.get("token_times")
                return [float(t) for t in times] if isinstance(times, list) else None
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None
