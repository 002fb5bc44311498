"""`pdd generate`: run the colocated reference engine on one prompt and show its timings.

Importing this module imports nothing heavy; torch comes in when the handler runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pddnet.model.cli import add_model_argument


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate a completion with the colocated reference engine",
        description="Tokenise the prompt (--prompt, --prompt-file or --prompt-ids: exactly one), "
        "run it through the reference engine (paged KV, continuous batching "
        "scheduler) and print the completion, its token ids and how long prefill and "
        "each decode step took.",
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", metavar="TEXT", help="prompt text (the tokenizer's BOS is put in front)"
    )
    prompt.add_argument(
        "--prompt-file",
        metavar="PATH",
        help="read the prompt from a file, - for stdin, byte for byte (a final "
        "newline included: printf or echo -n leave it out). With a preset's "
        "byte vocabulary any bytes are taken as they are (NUL too); a "
        "checkpoint's tokenizer needs UTF-8. BOS is put in front",
    )
    prompt.add_argument(
        "--prompt-ids",
        metavar="ID,ID,...",
        help="the prompt's token ids, separated by commas, used exactly as given "
        "(no BOS added); each must be in the model's vocabulary",
    )
    add_model_argument(parser, default="small")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (default: a fresh one when --temperature > 0)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k best tokens (0 = all)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.set_defaults(handler=_generate)


def parse_prompt_ids(text: str) -> list[int]:
    """ "1, 2,3" -> [1, 2, 3]; ValueError naming the offending item."""
    if not text.strip():
        raise ValueError("--prompt-ids: no token ids given")
    items = [item.strip() for item in text.split(",")]
    if items and items[-1] == "" and len(items) > 1:
        items.pop()  # a trailing comma
    ids: list[int] = []
    for n, item in enumerate(items, 1):
        try:
            value = int(item)
        except ValueError:
            raise ValueError(
                f"--prompt-ids: item {n} ({item!r}) is not an integer token id; "
                f"expected ids separated by commas, e.g. 1,2,3"
            ) from None
        if value < 0:
            raise ValueError(f"--prompt-ids: item {n} ({value}) is negative; token ids are >= 0")
        ids.append(value)
    return ids


def read_prompt_file(path: str) -> bytes:
    """The prompt file's bytes; "-" reads stdin to its end."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"--prompt-file: cannot read {path}: {exc.strerror or exc}") from None


def prompt_token_ids(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt of --prompt / --prompt-file / --prompt-ids as token ids for this model."""
    if args.prompt_ids is not None:
        ids = parse_prompt_ids(args.prompt_ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"--prompt-ids: {', '.join(map(str, bad[:5]))}"
                f"{' ...' if len(bad) > 5 else ''} outside the vocabulary of "
                f"{args.model} (ids 0..{vocab_size - 1})"
            )
        return ids
    if args.prompt_file is not None:
        from pddnet.model.tokenizer import ByteTokenizer

        data = read_prompt_file(args.prompt_file)
        if isinstance(tokenizer, ByteTokenizer):  # ids 0..255 are the bytes themselves
            return [tokenizer.bos_token_id, *data]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"--prompt-file: not UTF-8 at byte {exc.start} (this model's "
                f"tokenizer takes text; --prompt-ids takes token ids)"
            ) from None
        return tokenizer.encode(text, add_bos=True)
    return tokenizer.encode(args.prompt, add_bos=True)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from pddnet.engine.engine import Engine
    from pddnet.engine.sampling import SamplingParams
    from pddnet.model.loader import load_model

    def fail(message: str) -> int:
        print(f"pdd generate: {message}", file=sys.stderr)
        return 2

    if args.max_tokens < 1:
        return fail(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.threads is not None and args.threads < 1:
        return fail(f"--threads must be >= 1, got {args.threads}")
    if args.block_size < 1:
        return fail(f"--block-size must be >= 1, got {args.block_size}")
    if args.prompt_ids is not None:
        try:  # a malformed list is said before the model loads
            parse_prompt_ids(args.prompt_ids)
        except ValueError as exc:
            return fail(str(exc))
    torch.set_num_threads(args.threads or 1)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    t_load = time.perf_counter()
    try:
        sampling.validate()
        model, tokenizer = load_model(args.model)
    except ValueError as exc:
        return fail(str(exc))
    load_s = time.perf_counter() - t_load
    try:
        prompt = prompt_token_ids(args, tokenizer, model.config.vocab_size)
    except ValueError as exc:
        return fail(str(exc))
    blocks = -(-(len(prompt) + args.max_tokens) // args.block_size) + 1
    engine = Engine(
        model,
        tokenizer,
        num_blocks=blocks,
        block_size=args.block_size,
        max_num_batched_tokens=max(2048, args.block_size),
    )
    try:
        rid = engine.add_request(prompt, args.max_tokens, sampling, ignore_eos=args.ignore_eos)
    except ValueError as exc:
        return fail(str(exc))
    seq = engine.get_sequence(rid)
    prefill_s = 0.0
    decode_s: list[float] = []
    tokens: list[int] = []
    while not seq.is_finished:
        outputs = engine.step()
        assert engine.last_step is not None and outputs
        if not tokens:  # every step until the first token is prefill (chunked if long)
            prefill_s += engine.last_step.duration_s
        else:
            decode_s.append(engine.last_step.duration_s)
        for out in outputs:
            tokens += out.new_token_ids
    text = tokenizer.decode(tokens)
    result = {
        "model": model.config.name,
        "prompt_token_ids": prompt,
        "token_ids": tokens,
        "text": text,
        "finish_reason": str(seq.finish_reason),
        "seed": seq.sampling.seed,
        "timings": {
            "load_s": load_s,
            "prefill_s": prefill_s,
            "prefill_tokens": len(prompt),
            "decode_s": decode_s,
            "decode_mean_s": sum(decode_s) / len(decode_s) if decode_s else None,
        },
    }
    engine.close()
    if args.json:
        print(json.dumps(result))
        return 0
    # Random-weight presets emit arbitrary bytes: escape control characters for the terminal.
    print("".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text))
    print(f"prompt token ids ({len(prompt)}): {prompt}")
    print(f"token ids ({len(tokens)}, {result['finish_reason']}): {tokens}")
    if seq.sampling.seed is not None:
        print(f"seed: {seq.sampling.seed}")
    print(f"model {model.config.name} ({model.config.dtype}), loaded in {load_s * 1e3:.1f} ms")
    print(f"prefill: {len(prompt)} tokens in {prefill_s * 1e3:.2f} ms")
    if decode_s:
        steps = " ".join(f"{s * 1e3:.2f}" for s in decode_s)
        print(
            f"decode: {len(decode_s)} steps, mean {result['timings']['decode_mean_s'] * 1e3:.2f} "
            f"ms; each (ms): {steps}"
        )
    return 0
