"""The simulator's token-id handoff on counts: RelayHandoff's and MainHandoff's rules, without
their per-token calls.

The daemons' machines (pddnet.lifecycle.handoff) take a call per token and keep the token ids.
The simulator has neither (its decode instances run in segments of steps, tokens are counts),
and a 1M-request run cannot afford a machine object and a token list per request, so
SimulatedSystem keeps these rules instead. tests/test_sim_handoff_differential.py drives random
traces through them and through the machines and checks both make the same transitions: the
mode (both call HandoffPolicy.decide), the cut position, the HANDOFFs and TAKEOVERs, the tokens
MD extends per step. Where the simulator's model is coarser, that test pins the difference:

- One message per HANDOFF burst: RelayHandoff splits a streaming burst into HANDOFFs of at most
  `chunk` ids, sent at the same moment; the simulator sends their ids as one message (one
  header on the WAN instead of one per piece).
- The held token: MD's held sequence leaves the last token it was given uncomputed (the engine
  computes it with the step that samples). The simulator digests all of a streamed backlog
  before MD reports, and extends the final HANDOFF's tokens without it: the same tokens in
  all, one more in the streamed part, one fewer after the cut.
- No forwarding: while streaming, RelayHandoff forwards each further `chunk` of tokens RLD
  makes; the simulator sends them all with the final cut (it has no per-token events on RLD).
- MD knows at once when RLD finished a request: it sends no TAKEOVER then, where MD's daemon
  may send one that crosses RLD's cancel (and that RLD ignores).
"""

from __future__ import annotations

from pddnet.policy.handoff import HandoffMode, HandoffPolicy

# What RLD does with a TAKEOVER from MD (RelayHandoff.takeover / md_progress)
TAKEOVER_PARK = 0  # RLD has not emitted P's first token yet: it answers when it does
TAKEOVER_DECIDE = 1  # MD's first TAKEOVER: the policy picks the mode
TAKEOVER_CUT = 2  # MD's progress report during a streaming handoff: the final cut


def takeover_step(rld_started: bool, mode: HandoffMode | None) -> int:
    """Which of the three a TAKEOVER is, on RLD: ``mode`` is None until the first is decided."""
    if not rld_started:
        return TAKEOVER_PARK
    return TAKEOVER_DECIDE if mode is None else TAKEOVER_CUT


def first_cut(policy: HandoffPolicy, backlog: int, rld_load: float) -> tuple[HandoffMode, bool]:
    """At MD's first TAKEOVER, with ``backlog`` tokens made (P's first included): the mode, and
    whether RLD cuts now. One-shot does; streaming does too when MD is already within one
    extend step of RLD (``backlog <= chunk``), else it sends the backlog first (non-final)."""
    mode = policy.decide(backlog, rld_load).mode
    return mode, mode is HandoffMode.ONE_SHOT or backlog <= policy.chunk


def md_extend_chunk(mode: HandoffMode, ids: int, chunk: int) -> int:
    """Tokens MD extends per step for a HANDOFF of ``ids`` tokens: one-shot all at once (MD's
    SetChunk(None)), streaming at most ``chunk`` (SetChunk(chunk))."""
    return ids if mode is HandoffMode.ONE_SHOT else chunk
