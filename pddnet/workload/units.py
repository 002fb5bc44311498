"""The simulator's request: a prompt as a sequence of *units*, each standing for many tokens.

One unit stands for ``tokens_per_unit`` consecutive tokens (1 for the calibration runs, where
units are the testbed's real token ids; 16-512 at datacenter scale, where a 64K-token prompt
becomes a few hundred units). Every prefix cache in the simulator (MD's DRC, P's cache) is a real
``RadixCache`` over these units, so its matching, locking and eviction are exactly the daemons';
only its granularity is coarser. Two sources stream them in arrival order:
pddnet.workload.agent_stream (the seeded agent generator) and pddnet.workload.trace (JSONL).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    conversation: int
    arrival_s: float
    units: tuple[int, ...]  # prompt content, one id per unit
    prompt_tokens: int
    output_tokens: int
    output_units: tuple[int, ...]  # what the reply adds to the conversation's history

    def sent_at(self, t: float) -> SimRequest:
        """The same request offered at ``t`` (``dataclasses.replace``, compiled: once per turn)."""
        return SimRequest(
            self.rid,
            self.conversation,
            t,
            self.units,
            self.prompt_tokens,
            self.output_tokens,
            self.output_units,
        )


def units_for(tokens: int, tokens_per_unit: int) -> int:
    return max(1, -(-tokens // tokens_per_unit))
