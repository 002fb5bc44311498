"""The host's share of one long request's path, no model compute: the router parses the client's
JSON (a 64K-token prompt of ids) and builds SUBMIT; P decodes it and builds KV_ALLOC_REQUEST from
its prompt; the decode tier decodes that; P's engine admits the prompt (add_request, then abort).
Prints the median ms of each over --repeats, for the pddnet on the import path (run it once per
checkout to compare two commits: PYTHONPATH=CHECKOUT python scripts/bench_host_path.py)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pddnet.api.parse import parse_completion_request
from pddnet.api.types import ModelInfo
from pddnet.engine.engine import Engine
from pddnet.model.loader import load_model
from pddnet.protocol.frame import decode_bytes, encode_bytes
from pddnet.protocol.messages import KvAllocRequest, Submit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64000)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    n = args.tokens
    model = ModelInfo("m", 152064, 1 << 20, 2)
    body = json.dumps({"model": "m", "prompt": [(7 * j) % 150000 + 3 for j in range(n)]})
    wire: list[float] = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        req = parse_completion_request(json.loads(body), model, None, 1024)
        sub = Submit(request_id="c1", prompt_token_ids=req.prompt_token_ids, max_tokens=8)
        at_p = decode_bytes(encode_bytes(sub))
        alloc = KvAllocRequest(
            request_id="c1",
            prompt_token_ids=at_p.prompt_token_ids,
            num_tokens=n,
            num_layers=28,
            num_kv_heads=4,
            head_dim=128,
            dtype="bfloat16",
            block_size=16,
            expected_hit_tokens=0,
            max_tokens=8,
        )
        decode_bytes(encode_bytes(alloc))
        wire.append((time.perf_counter() - t0) * 1e3)
    tiny, tok = load_model("tiny-window")
    ids = tuple((7 * j) % 250 + 3 for j in range(n))
    admit: list[float] = []
    with Engine(tiny, tok, num_blocks=n // 16 + 64, block_size=16) as engine:
        for i in range(args.repeats):
            t0 = time.perf_counter()
            rid = engine.add_request(ids, max_tokens=1, ignore_eos=True, request_id=f"r{i}")
            admit.append((time.perf_counter() - t0) * 1e3)
            engine.abort(rid)
    print(
        f"{n} tokens, median of {args.repeats}: router parse -> SUBMIT -> P -> KV_ALLOC_REQUEST "
        f"-> decode tier {statistics.median(wire):.1f} ms; engine add_request "
        f"{statistics.median(admit):.1f} ms; load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
