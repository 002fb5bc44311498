"""pddnet.engine: sequences, scheduler (continuous batching, chunked prefill), model runner,
sampler, and the colocated reference ``Engine``.

Names are imported lazily so that ``pddnet.engine.cli`` (loaded by ``pdd --help``) does not pull
in torch.
"""

from __future__ import annotations

from pddnet.lazy import lazy_exports

_EXPORTS = {
    "Engine": "pddnet.engine.engine",
    "StepOutput": "pddnet.engine.engine",
    "StepStats": "pddnet.engine.engine",
    "KVReservation": "pddnet.engine.engine",
    "Sequence": "pddnet.engine.sequence",
    "SequenceStatus": "pddnet.engine.sequence",
    "FinishReason": "pddnet.engine.sequence",
    "Scheduler": "pddnet.engine.scheduler",
    "BlockManager": "pddnet.engine.scheduler",
    "ScheduledChunk": "pddnet.engine.scheduler",
    "ModelRunner": "pddnet.engine.runner",
    "Chunk": "pddnet.engine.runner",
    "SamplingParams": "pddnet.engine.sampling",
    "sample_token": "pddnet.engine.sampling",
    "sample_batch": "pddnet.engine.sampling",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
