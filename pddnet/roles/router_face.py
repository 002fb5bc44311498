"""What the HTTP side uses of the router: the HTTP front (pddnet/roles/http_api.py) and the
answer to one completion (pddnet/roles/completion.py) are typed against `RouterFace`, not against
pddnet/roles/router.py's `Router`, so the router can build its HTTP front without an import circle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pddnet.api.types import CompletionRequest, ModelInfo
    from pddnet.config import ClusterConfig
    from pddnet.lifecycle.actions import RouterAction
    from pddnet.lifecycle.router_request import RouterRequest
    from pddnet.model.tokenizer import Tokenizer
    from pddnet.obs.metrics import RouterMetrics
    from pddnet.roles.event_lanes import EventLanes
    from pddnet.roles.peer import Peer


class RouterFace(Protocol):
    """The router's attributes and methods that the HTTP front and a completion use."""

    config: ClusterConfig
    clock: Callable[[], float]
    dilation: float  # reported times are the modelled world's (/ dilation)
    model: ModelInfo
    tokenizer: Tokenizer
    lanes: EventLanes
    peers: dict[str, Peer]
    requests: dict[str, RouterRequest]
    counters: dict[str, int]
    tokens_by_producer: dict[str, int]
    metrics: RouterMetrics

    def stats(self) -> dict[str, Any]: ...

    def admit(
        self, req: CompletionRequest, rid: str, changed: asyncio.Event
    ) -> list[RouterRequest]: ...

    async def submit(self, state: RouterRequest) -> None: ...

    async def apply(self, state: RouterRequest, actions: list[RouterAction]) -> None: ...

    async def cancel(self, state: RouterRequest, reason: str) -> None: ...

    def forget(self, states: list[RouterRequest]) -> None: ...
