"""Benchmark of the KV transport backends: the same KV of the same requests through each.

For a set of requests (mixed prompt lengths, the KV shape of a model preset), in one run:
  memcpy    a plain copy of the same bytes into a second pool (the ceiling)
  shm       one-sided writes into a receiver's shared-memory pool (pddnet's emulated RDMA)
  tcp       KV_CHUNK frames on striped loopback TCP lanes, imported by a receiver process
  mooncake  Mooncake Transfer Engine writes (protocol tcp, loopback) into a receiver process's
            registered pool (skipped, with the reason, where mooncake cannot be imported)
The receiver is a separate process for every backend; a write counts as done when the bytes
are in the receiver's pool (tcp: when the receiver has imported them). Each backend's pool is
hashed at the end to check that all moved the same bytes to the same blocks. Prints goodput as
ratios to memcpy and to each other, and the sender's event-loop lateness (p50/p99 of a 1 ms
ticker) while the transfers run. Writes results/kv_backends/<timestamp>.json. Bounded: the
request set is fixed, each backend runs it `--repeat` times.

    python scripts/bench_kv_backends.py [--model small] [--lengths 256,1024,4096] [--repeat 3]

BENCH_RX_LOG=FILE keeps the receiver processes' stderr (the engine's logs) in FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pddnet.kv.pool import KVPool, KVSpec  # noqa: E402
from pddnet.kv.shm import unique_segment_name  # noqa: E402
from pddnet.kv.transfer import export_kv  # noqa: E402
from pddnet.model.config import ModelConfig  # noqa: E402
from pddnet.transport import dial  # noqa: E402
from pddnet.transport.backends import (  # noqa: E402
    MooncakeSettings,
    create_backend,
    mooncake_import_error,
)
from pddnet.transport.kv_backend import WriteTarget  # noqa: E402
from pddnet.transport.stripes import StripedSender  # noqa: E402

SECRET = b"bench-kv-backends"
BLOCK = 16

# The receiving process: makes the pool, registers it, answers "hash" and "wait BYTES" on stdin.
RECEIVER = r"""
import asyncio, json, sys
import torch, xxhash
torch.set_num_threads(1)
from pddnet.kv.pool import KVPool, KVSpec
from pddnet.transport.backends import create_backend, MooncakeSettings
from pddnet.transport import Server
from pddnet.transport.kv_backend import WriteTarget

async def main():
    name, spec_json, blocks, shm = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    tables = json.loads(sys.argv[5])  # request index -> its block table here
    pool = KVPool(KVSpec(**json.loads(spec_json)), blocks, shm_name=shm or None)
    backend = await create_backend(name, mooncake=MooncakeSettings())
    sink = await backend.register(pool)
    got = {"bytes": 0}
    info = {"descriptor": sink.descriptor}
    server = None
    if name == "tcp":
        targets = [WriteTarget(tuple(t), pool.spec.block_size, 0) for t in tables]
        loop = asyncio.get_running_loop()

        async def handle(conn):
            async for msg in conn:
                target = targets[int(msg.request_id.rsplit("-", 1)[1])]
                # The import runs off the loop, as MD's engine thread does it.
                try:
                    n = await loop.run_in_executor(None, sink.receive, msg, target)
                    got["bytes"] += n  # not `+= await`: that would read the count before it
                except Exception as exc:
                    print("receive failed:", repr(exc), file=sys.stderr, flush=True)
                    raise
        server = Server("127.0.0.1", 0, role="main_decode", instance_id="bench-md",
                        secret=b"bench-kv-backends", on_connection=handle)
        info["port"] = await server.start()
    print(json.dumps(info), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line:
            break
        if line[0] == "wait":
            give_up = loop.time() + 120  # bounded: a lost chunk must not leave us behind
            while got["bytes"] < int(line[1]) and loop.time() < give_up:
                await asyncio.sleep(0.001)
            print("ok" if got["bytes"] >= int(line[1]) else "short", flush=True)
            got["bytes"] = 0
        elif line[0] == "hash":
            print(xxhash.xxh3_64_hexdigest(pool.raw_bytes().numpy().tobytes()), flush=True)
    if server is not None:
        await server.close()
    await backend.close()
    pool.close()

asyncio.run(main())
"""


class ReceiverProcess:
    def __init__(self, backend: str, spec: KVSpec, blocks: int, tables: list) -> None:
        self.shm = unique_segment_name("bench-kv") if backend == "shm" else ""
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                RECEIVER,
                backend,
                json.dumps(spec.to_dict()),
                str(blocks),
                self.shm,
                json.dumps([list(t) for t in tables]),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.environ.get("BENCH_RX_LOG", os.devnull), "a"),
            env=env,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            self.end()
            raise RuntimeError(f"the {backend} receiver died before describing its pool")
        self.info = json.loads(line)

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class LoopLateness:
    """How late a 1 ms ticker wakes while transfers run: the event loop's responsiveness."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.001)
            self.samples.append(loop.time() - t - 0.001)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> dict[str, float]:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        s = sorted(self.samples) or [0.0]
        return {
            "p50_ms": 1e3 * s[len(s) // 2],
            "p99_ms": 1e3 * s[min(len(s) - 1, int(len(s) * 0.99))],
            "max_ms": 1e3 * s[-1],
            "samples": len(s),
        }


def requests(
    spec: KVSpec, lengths: list[int], seed: int, scatter: bool = False
) -> tuple[KVPool, list[tuple]]:
    """P's pool with every request's prompt KV, and (table_in_P, table_at_receiver, n)."""
    blocks = [math.ceil(n / BLOCK) for n in lengths]
    src = KVPool(spec, sum(blocks))
    g = torch.Generator().manual_seed(seed)
    src.data.copy_(torch.randn(src.data.shape, generator=g, dtype=torch.float32))
    out, first = [], 0
    for n, b in zip(lengths, blocks, strict=True):
        table = list(range(first, first + b))
        # A fresh receiver pool hands out consecutive blocks; --scatter reverses them, so that
        # no two blocks merge into one run (the worst case for per-segment costs).
        out.append((table, tuple(reversed(table)) if scatter else tuple(table), n))
        first += b
    return src, out


def memcpy_run(src: KVPool, reqs: list[tuple], repeat: int) -> dict[str, Any]:
    exports = [export_kv(src, table, 0, n) for table, _, n in reqs]
    outs = [torch.zeros_like(ex.kv) for ex in exports]  # touched once: no page faults timed
    t0 = time.perf_counter()
    moved = 0
    for _ in range(repeat):
        for ex, out in zip(exports, outs, strict=True):
            out.copy_(ex.kv)
            moved += ex.kv.numel() * ex.kv.element_size()
    return {"seconds": time.perf_counter() - t0, "bytes": moved}


async def backend_run(
    name: str, src: KVPool, reqs: list[tuple], repeat: int, stripes_n: int, chunk_tokens: int
) -> dict[str, Any]:
    rx = ReceiverProcess(name, src.spec, src.num_blocks, [dst for _, dst, _ in reqs])
    stripes = None
    try:
        if name == "tcp":
            lanes = [
                await dial(
                    "127.0.0.1",
                    rx.info["port"],
                    role="prefill",
                    instance_id="bench-p",
                    lane="bulk",
                    secret=SECRET,
                )
                for _ in range(stripes_n)
            ]
            stripes = StripedSender(lanes)
        backend = await create_backend(
            name,
            stripes=stripes,
            chunk_tokens=chunk_tokens,
            deadline_s=30.0,
            mooncake=MooncakeSettings(deadline_s=30.0),
        )
        writer = await backend.open(rx.info["descriptor"])
        # Export (P's engine-thread work) is the same for all backends: done before timing.
        exports = [(export_kv(src, table, 0, n), dst) for table, dst, n in reqs]
        lateness = LoopLateness()
        lateness.start()
        t0 = time.perf_counter()
        moved = 0
        for r in range(repeat):
            this_round = 0
            for i, (ex, dst_table) in enumerate(exports):
                xfer = writer.begin(f"bench-{r}-{i}", WriteTarget(dst_table, BLOCK, 0))
                this_round += await xfer.write(ex)
            if name == "tcp":  # queued on the lanes is not yet landed: wait for the import
                reply = await asyncio.get_running_loop().run_in_executor(
                    None, rx.ask, f"wait {this_round}"
                )
                if reply != "ok":
                    raise RuntimeError(f"the tcp receiver got less than {this_round} bytes")
            moved += this_round
        seconds = time.perf_counter() - t0
        loop_stats = await lateness.stop()
        digest = rx.ask("hash")
        await backend.close()
        return {"seconds": seconds, "bytes": moved, "pool_hash": digest, "loop": loop_stats}
    finally:
        if stripes is not None:
            await stripes.close()
        rx.end()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="preset whose KV shape is used")
    ap.add_argument("--lengths", default="256,1024,4096", help="prompt lengths (positions)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stripes", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument(
        "--scatter",
        action="store_true",
        help="receiver blocks in reverse order (no contiguous runs)",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "kv_backends"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig.preset(args.model)
    spec = KVSpec.from_model_config(cfg, block_size=BLOCK, dtype="float32")
    lengths = [int(x) for x in args.lengths.split(",")]
    src, reqs = requests(spec, lengths, seed=0, scatter=args.scatter)
    print(
        f"KV of {args.model}: {spec.bytes_per_token} B/position; requests {lengths} x "
        f"{args.repeat}: {args.repeat * sum(lengths) * spec.bytes_per_token / 2**20:.1f} MiB"
    )
    results: dict[str, Any] = {"memcpy": memcpy_run(src, reqs, args.repeat)}
    skipped: dict[str, str] = {}
    for name in ("shm", "tcp", "mooncake"):
        if name == "mooncake" and mooncake_import_error():
            skipped[name] = mooncake_import_error() or ""
            continue
        results[name] = await backend_run(
            name, src, reqs, args.repeat, args.stripes, args.chunk_tokens
        )
    for r in results.values():
        r["goodput_gbps"] = r["bytes"] * 8 / r["seconds"] / 1e9
    base = results["memcpy"]["goodput_gbps"]
    print(f"\n{'path':<10}{'GB/s':>8}{'x memcpy':>10}{'loop p50 ms':>13}{'loop p99 ms':>13}")
    for name, r in results.items():
        loop = r.get("loop", {})
        print(
            f"{name:<10}{r['goodput_gbps'] / 8:>8.2f}{r['goodput_gbps'] / base:>10.3f}"
            f"{loop.get('p50_ms', float('nan')):>13.2f}{loop.get('p99_ms', float('nan')):>13.2f}"
        )
    names = [n for n in results if n != "memcpy"]
    ratios = {
        f"{a}/{b}": results[a]["goodput_gbps"] / results[b]["goodput_gbps"]
        for a in names
        for b in names
        if a != b
    }
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    hashes = {n: results[n]["pool_hash"] for n in names}
    same = len(set(hashes.values())) == 1
    print(f"same bytes in every receiver pool: {same} {hashes}")
    for n, why in skipped.items():
        print(f"skipped {n}: {why}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, time.strftime("%Y%m%d-%H%M%S") + ".json")
    with open(path, "w") as f:
        json.dump(
            {
                "model": args.model,
                "scatter": args.scatter,
                "bytes_per_position": spec.bytes_per_token,
                "lengths": lengths,
                "repeat": args.repeat,
                "results": results,
                "ratios": ratios,
                "same_bytes": same,
                "skipped": skipped,
                "host_cpus": os.cpu_count(),
            },
            f,
            indent=2,
        )
    print(f"wrote {path}")
    if not same:
        sys.exit("backends disagree on the bytes they moved")


if __name__ == "__main__":
    asyncio.run(main())
