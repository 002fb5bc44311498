"""Readiness: the links each daemon needs, and the router's picture of them.

A daemon is ready when it has started (model loaded, listening) and every lane it dials is up:
P's control lanes to RLD and MD and its bulk stripes to MD, RLD's control lane to MD. It says so
to the router in LINK_STATE messages (on every change, and all of them when the router's events
lane connects); the router's /health is ok only when every daemon is connected and ready, and
otherwise names the links it is waiting for. Sans-IO: states in, verdicts and text out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pddnet.protocol.messages import LinkState

STARTED = "started"  # the daemon's own link: it has loaded its model and dialled its peers


@dataclass(frozen=True)
class Link:
    """One link's state: up or down, since when (wall clock), and why it is down."""

    up: bool
    since: float
    detail: str = ""

    def message(self, name: str, ready: bool) -> LinkState:
        return LinkState(
            link=name, up=self.up, since=self.since, detail=self.detail[:4096], ready=ready
        )

    def describe(self, name: str) -> str:
        """E.g. "main-decode control down since 12:00:01.25 (heartbeat deadline ...)"."""
        state = "up" if self.up else "down"
        text = f"{name} {state} since {clock_text(self.since)}"
        return f"{text} ({self.detail})" if self.detail and not self.up else text


def clock_text(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 100) % 100:02d}"


def all_up(links: dict[str, Link]) -> bool:
    return bool(links) and all(link.up for link in links.values())


class DaemonLinks:
    """The router's picture of one daemon's links, from the LINK_STATE messages it sends.

    Nothing is known (so: not ready) until the daemon has reported, and again once its events
    lane is lost: a reconnected daemon reports everything anew."""

    def __init__(self) -> None:
        self.links: dict[str, Link] = {}
        self.ready = False

    def apply(self, msg: LinkState) -> None:
        self.links[msg.link] = Link(msg.up, msg.since, msg.detail)
        self.ready = msg.ready

    def reset(self) -> None:
        self.links.clear()
        self.ready = False

    def waiting_for(self, role: str) -> list[str]:
        """What keeps the daemon from being ready, one line per link."""
        if not self.links:
            return [f"{role}: has not reported its links yet"]
        down = [
            f"{role}: {link.describe(name)}" for name, link in self.links.items() if not link.up
        ]
        if not down and not self.ready:  # a link we have not heard of yet
            down = [f"{role}: not ready (links still being reported)"]
        return down

    def to_json(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "links": {
                name: {
                    "up": link.up,
                    "since": link.since,
                    **({"detail": link.detail} if link.detail else {}),
                }
                for name, link in self.links.items()
            },
        }
