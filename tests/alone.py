"""A test that must not share the cores with another pytest-xdist worker's test: one lock per
run, taken shared by every test and exclusively by such a test (tests/conftest.py decides which).

Two lock files in a folder all workers of the run share. A test that wants the lock exclusively
holds the turnstile while it waits, so the other workers, which pass the turnstile before each of
their tests, cannot keep the lock shared forever: they stop between two tests, it runs alone,
then they go on."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def turn(folder: Path, alone: bool) -> Iterator[None]:
    """Hold the run's test lock for one test: exclusively if `alone`, else shared."""
    with (
        open(folder / "pddnet-tests.turnstile", "a") as turnstile,
        open(folder / "pddnet-tests.lock", "a") as lock,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
