"""Seeded workloads, one for every consumer: the benchmarks send them, the simulator streams them.

poisson: long prompts at Poisson arrivals. agent: multi-turn agent conversations (hits: how much
of them an ideal prefix cache hits). units: the simulator's request in units of tokens, streamed
from the agent generator (agent_stream) or from a JSONL trace (trace).
"""
