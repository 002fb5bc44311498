"""One progress bar for every benchmark: tqdm when it is installed, a plain line otherwise.

    with progress(total=24, desc="pdd") as bar:
        ...; bar.update(1); bar.set_postfix(ttft="512 ms")

The fallback prints one short line per 10% (to stderr), so a long run still shows it is alive
where tqdm is missing; `enabled=False` silences both (the smoke tests).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def set_postfix(self, **values: Any) -> None: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass


class _Lines:
    """tqdm's two calls, as a line every 10% of `total`."""

    def __init__(self, total: int, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit = max(total, 1), desc, unit
        self.n, self._shown, self._t0 = 0, -1, time.monotonic()
        self._postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        decile = 10 * self.n // self.total
        if decile != self._shown:
            self._shown = decile
            print(
                f"{self.desc}: {self.n}/{self.total} {self.unit} "
                f"({time.monotonic() - self._t0:.0f} s){self._postfix}",
                file=sys.stderr,
                flush=True,
            )

    def set_postfix(self, **values: Any) -> None:
        self._postfix = "  " + ", ".join(f"{k}={v}" for k, v in values.items())


def tqdm_available() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def progress(total: int, desc: str, unit: str = "req", enabled: bool = True) -> Iterator[Progress]:
    """A progress bar over `total` units, closed when the block ends."""
    if not enabled:
        yield _Silent()
        return
    if tqdm_available():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True)
        try:
            yield bar
        finally:
            bar.close()
        return
    yield _Lines(total, desc, unit)
