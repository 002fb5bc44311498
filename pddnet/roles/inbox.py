"""Reading one connection until it closes (outbox.py's counterpart): PINGs are answered by the
reader at once, every other message is handled in order by a second task, so a handler waiting
for the engine (an allocation behind a long step) never delays a PONG past its deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from pddnet.protocol import Message, Ping, Pong
from pddnet.transport import Connection, ConnectionClosed

INBOX_LIMIT = 4096  # messages read ahead of the handler on one connection


async def read_in_order(
    conn: Connection,
    handle: Callable[[Message], Awaitable[None]],
    on_pong: Callable[[Pong], None],
    name: str,
) -> None:
    """Answer PINGs, pass PONGs to ``on_pong``, and ``handle`` everything else one message at a
    time, in arrival order, until the connection closes and the last message is handled."""
    inbox: asyncio.Queue[Message | None] = asyncio.Queue(maxsize=INBOX_LIMIT)

    async def handle_in_order() -> None:
        while (msg := await inbox.get()) is not None:
            await handle(msg)

    worker = asyncio.get_running_loop().create_task(handle_in_order(), name=name)
    try:
        async for msg in conn:
            if isinstance(msg, Ping):  # heartbeats are answered at once, on any lane
                with contextlib.suppress(ConnectionClosed):
                    await conn.send(Pong(nonce=msg.nonce, time=msg.time))
            elif isinstance(msg, Pong):
                on_pong(msg)
            else:
                await inbox.put(msg)  # a full inbox stops reading: backpressure
        await inbox.put(None)
        await worker
    finally:
        if not worker.done():
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
