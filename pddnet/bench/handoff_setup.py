"""handoff bench: what each handoff starts from, computed once per prompt and not timed: P's
prompt KV, RLD's relay tokens (decoded once to the largest relay count; a cut at n replays its
first n) and the colocated reference engine's output, the oracle MD's tokens are checked against.

RLD's and MD's engines are built once per run and kept warm (`engine_for`, as each role's daemon
builds its long-lived engine: its block size, batch budget and prefix cache), so that every paced
forward is a steady-state one; only the setup engines (P, the reference) are per prompt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pddnet.bench.handoff_devices import paced_step
from pddnet.device.pacer import StepPacer

TOKEN_ID = "token-id"
KV_DIRECT = "kv-direct"
PATHS = (TOKEN_ID, KV_DIRECT)
BLOCK_SIZE = 16

# -- setup per prompt (RLD's thread; not timed) ---------------------------------------------------


@dataclass
class Prepared:
    """One prompt's state: what P computed, what RLD decoded, and the reference's tokens."""

    index: int
    prompt: list[int]
    sampling: Any  # SamplingParams
    prompt_kv: Any  # ExportedKV of positions [0, prompt): P's copy, as MD gets it
    relay: list[int]  # output indices 0..n_max: P's first token, then RLD's tokens
    reference: list[int]  # the colocated engine's output, indices 0..n_max + 2
    rld_engine: Any
    rld_request: str

    @property
    def first(self) -> int:
        return self.relay[0]


def engine_for(model: Any, tok: Any, role: str, *sequences: int) -> Any:
    """An engine as `role`'s daemon builds one (pddnet/roles/engine_host.py: the config
    section's block size, batch budget and prefix cache; MD's is the radix tree, the others'
    the hash cache), its pool sized to hold sequences of these token counts at once."""
    from pddnet.config import ClusterConfig
    from pddnet.engine.engine import Engine

    sec = getattr(ClusterConfig(), role)
    assert sec.block_size == BLOCK_SIZE, "the bench's prompts are cut at BLOCK_SIZE"
    return Engine(
        model,
        tok,
        num_blocks=sum(-(-t // BLOCK_SIZE) + 1 for t in sequences) + 4,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=sec.max_num_batched_tokens,
        enable_prefix_cache=sec.prefix_cache != "off",
        prefix_cache_kind="radix" if sec.prefix_cache == "radix" else "hash",
    )


def relay_tokens_needed(prompt_len: int, n_max: int) -> int:
    """Tokens RLD's sequence of a prompt holds: MD samples indices n+1 and n+2 after a cut
    at n, so the reference runs to n_max + 3 outputs."""
    return prompt_len + n_max + 3


def prepare_prompt(
    model: Any,
    tok: Any,
    index: int,
    prompt: list[int],
    n_max: int,
    sampling: Any,
    rld: Any,
    pacer: StepPacer | None = None,
) -> Prepared:
    """`rld`: RLD's engine (`engine_for(..., "relay", ...)`), shared by every prompt of the run;
    the prompt's sequence stays on it, the relay tokens' KV that KV-direct exports. `pacer`: the
    relay's, when devices are emulated: RLD's decode steps are paced as its daemon's are (P's
    prefill, setup here, and the reference engine, the oracle, are not)."""
    from pddnet.kv.transfer import export_kv, import_kv

    length = len(prompt)
    total = relay_tokens_needed(length, n_max) - length
    ref_engine = engine_for(model, tok, "prefill", length + total)
    try:
        reference = ref_engine.generate(prompt, total, sampling, ignore_eos=True)
    finally:
        ref_engine.close()
    p = engine_for(model, tok, "prefill", length + 1)
    try:
        pid = p.add_request(prompt, 1, sampling, keep_blocks=True, ignore_eos=True)
        first: list[int] = []
        while not first:  # a long prompt is prefilled in several chunks, one per step
            first = [t for out in p.step() for t in out.new_token_ids]
        prompt_kv = export_kv(p.pool, p.get_sequence(pid).block_table, 0, length)
        p.release(pid)
    finally:
        p.close()
    res = rld.reserve_kv(prompt, total)
    import_kv(rld.pool, prompt_kv, res.block_ids)
    rid = rld.add_request(
        prompt, total, sampling, f"relay-{index}", ignore_eos=True, output_token_ids=first, kv=res
    )
    relay = list(first)
    while len(relay) < n_max + 1:
        relay += [t for out in paced_step(rld, pacer) for t in out.new_token_ids]
    # held from here on: the next prompt's steps must not decode this sequence further (it
    # would batch into their forwards and could finish, freeing the KV that KV-direct sends)
    rld.set_hold(rid, True)
    if relay != reference[: n_max + 1]:
        at = next(i for i, (a, b) in enumerate(zip(relay, reference, strict=False)) if a != b)
        raise RuntimeError(
            f"prompt {index}: RLD's tokens differ from the reference engine's "
            f"from output index {at} on"
        )
    return Prepared(index, prompt, sampling, prompt_kv, relay, reference, rld, rid)


def make_prompts(count: int, length: int, vocab: int, bos: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [bos] + [rng.randrange(min(256, vocab)) for _ in range(length - 1)] for _ in range(count)
    ]
