"""One fast check for long lists of ints (prompts, token ids, block ids), shared by the wire's
schema, the HTTP API and the engine: each of them had its own Python loop, and a 64K-token
prompt was walked ~10 times between the client's JSON and P's engine (~5-15 ms a walk)."""

from __future__ import annotations

import array
from collections.abc import Sequence

# array typecodes whose conversion checks [0, hi] in C, for the bounds the callers use
_RANGE_TYPECODES = {2**32 - 1: ("I",), 2**31 - 1: ("I", "i"), 2**64 - 1: ("Q",)}


def all_ints_within(values: Sequence[object], hi: int) -> bool:
    """Whether every item is an int (exactly: no bool, float or numpy int) in [0, hi], in
    C-speed passes: ~3 ms for a 64K-token prompt, where a Python loop takes 6-15 ms. Callers
    fall back to their own loop to name the first bad item."""
    if not set(map(type, values)) <= {int}:
        return False
    codes = _RANGE_TYPECODES.get(hi)
    if codes is None:
        return not values or (min(values) >= 0 and max(values) <= hi)  # type: ignore[operator]
    try:
        for code in codes:
            array.array(code, values)  # type: ignore[arg-type]
    except OverflowError:
        return False
    return True
