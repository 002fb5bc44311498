"""A daemon's engine: load the model, build the Engine and the one thread that steps it
(EngineWorker, paced on an emulated accelerator), run operations on it between steps, and hand
each step's outputs (or its failure) to the daemon."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from pddnet.config import ClusterConfig, DaemonSection
from pddnet.device.dilation import real_kv_bytes_per_token
from pddnet.device.emulated import Emulation
from pddnet.device.pacer import StepPacer
from pddnet.engine.engine import Engine, StepOutput
from pddnet.engine.worker import EngineWorker
from pddnet.lifecycle.sampling import sampling_of
from pddnet.model.loader import load_model
from pddnet.obs.step_times import StepTimes
from pddnet.protocol import KvAllocRequest, Submit

log = logging.getLogger("pddnet.roles")


class EngineHost:
    """The Daemon base's engine half (the Daemon sets these attributes in its __init__)."""

    role: str
    instance_id: str
    config: ClusterConfig
    section: DaemonSection
    counters: Counter[str]
    emulation: Emulation | None
    engine: Engine | None
    worker: EngineWorker | None
    pacer: StepPacer | None
    step_times: StepTimes
    _closing: bool

    def init_engine(self) -> None:
        """No engine until start; the modelled accelerator's pacing and clock (none: unpaced)."""
        self.engine = None
        self.worker = None
        self.dilation = self.emulation.dilation if self.emulation else 1.0
        # real / target KV bytes per token: real KV bytes on a wire stand for real / this
        self.wire_scale = (
            self.emulation.wire_scale(real_kv_bytes_per_token(self.config.model))
            if self.emulation
            else 1.0
        )
        self.pacer = (
            StepPacer(self.emulation.cost_of(self.role), self.dilation) if self.emulation else None
        )
        # every engine step's time as measured here (paced, in the modelled world's seconds)
        self.step_times = StepTimes(scale=1.0 / self.dilation)

    def kv_shm_name(self) -> str | None:
        """Name of a shared-memory KV pool, or None for a private one (RLD overrides)."""
        return None

    async def start_engine(self) -> None:
        """Load the model and start the engine thread."""
        model_cfg = self.config.model
        model, tokenizer = await asyncio.to_thread(
            load_model, model_cfg.name, model_cfg.dtype, model_cfg.seed
        )
        sec = self.section
        self.engine = Engine(
            model,
            tokenizer,
            num_blocks=sec.num_blocks,
            block_size=sec.block_size,
            max_num_batched_tokens=sec.max_num_batched_tokens,
            max_num_seqs=sec.max_num_seqs,
            kv_shm_name=self.kv_shm_name(),
            enable_prefix_cache=sec.prefix_cache != "off",
            prefix_cache_kind="radix" if sec.prefix_cache == "radix" else "hash",
        )
        self.worker = EngineWorker(
            self.engine,
            self._on_outputs,
            threads=model_cfg.threads,
            name=f"{self.role}-engine",
            on_error=self._on_engine_error,
            on_step_stats=self.step_times.observe,
            pacer=self.pacer,
            after_step=self.after_step_in_engine,
        )

    async def compute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run an engine operation in the engine thread, between steps."""
        assert self.worker is not None
        return await self.worker.call(fn, *args, **kwargs)

    async def add_sequence(self, req: Submit | KvAllocRequest, **options: Any) -> None:
        """Add a request's sequence to the engine, sampling as its wire fields say (every tier
        alike); ``options`` are add_request's (output_token_ids, kv...) and may override its
        max_tokens and ignore_eos. Raises ValueError if the engine refuses it."""
        assert self.engine is not None
        options = {"max_tokens": req.max_tokens, "ignore_eos": req.ignore_eos, **options}
        await self.compute(
            self.engine.add_request,
            req.prompt_token_ids,
            sampling=sampling_of(req),
            request_id=req.request_id,
            **options,
        )

    def wake(self) -> None:
        assert self.worker is not None
        self.worker.wake()

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        if self._closing:
            return
        try:
            self.on_step(outputs)
        except Exception:
            log.exception("%s: handling step outputs failed", self.instance_id)

    def on_step(self, outputs: list[StepOutput]) -> None:  # pragma: no cover
        raise NotImplementedError

    def after_step_in_engine(self, outputs: list[StepOutput]) -> None:
        """Hook, in the engine thread: a step's outputs just before `on_step` sees them."""

    def _on_engine_error(self, exc: BaseException) -> None:
        """An engine step raised (the worker logged it and waits for the next call). The
        requests it was computing would stall forever: fail them instead."""
        if self._closing:
            return
        self.counters["engine_errors"] += 1
        try:
            self.engine_failed(f"{self.role} engine step failed: {type(exc).__name__}: {exc}")
        except Exception:
            log.exception("%s: failing the requests of a broken step failed", self.instance_id)

    def engine_failed(self, reason: str) -> None:  # pragma: no cover
        """Fail (ERROR to the router, free the blocks) every request whose engine sequence a
        step may have touched; requests still waiting for their KV are not affected."""
        raise NotImplementedError
