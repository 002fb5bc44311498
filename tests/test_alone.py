"""tests/alone.py: shared holders run side by side; an exclusive one waits for them, and the next
shared one waits behind it (the turnstile), then each goes on in turn."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.alone import turn

SETTLE_S = 0.3  # how long a thread that should be blocked gets to (wrongly) get in


class Holder:
    """A thread inside turn(folder, alone) until released; `inside` is set once it got in."""

    def __init__(self, folder: Path, alone: bool) -> None:
        self.inside, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(folder, alone), daemon=True)
        self.thread.start()

    def _run(self, folder: Path, alone: bool) -> None:
        with turn(folder, alone):
            self.inside.set()
            self.release.wait(30)

    def leave(self) -> None:
        self.release.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_shared_holders_share_and_an_exclusive_one_waits_and_is_not_starved(tmp_path: Path):
    one, two = Holder(tmp_path, False), Holder(tmp_path, False)
    assert one.inside.wait(5) and two.inside.wait(5)  # shared: side by side
    alone = Holder(tmp_path, True)
    assert not alone.inside.wait(SETTLE_S)  # waits for both
    later = Holder(tmp_path, False)
    assert not later.inside.wait(SETTLE_S)  # behind the waiting exclusive one, not past it
    one.leave()
    assert not alone.inside.wait(SETTLE_S)
    two.leave()
    assert alone.inside.wait(5)
    assert not later.inside.wait(SETTLE_S)  # alone: nobody else inside
    alone.leave()
    assert later.inside.wait(5)
    later.leave()
