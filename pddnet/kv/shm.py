"""Named POSIX shared-memory segments (``/dev/shm/pdd-*``) that another process can map by name:
the one module that creates, attaches, names, finds and unlinks them (the KV pool lives in one,
the shm KV backend writes into a peer's, the cluster launcher removes a dead daemon's).

A segment is what later stands in for an RDMA-registered memory region: the owner creates it,
a peer attaches to the same bytes by name and writes into them directly (a one-sided write).

Why /dev/shm + mmap instead of ``multiprocessing.shared_memory``: on Python < 3.13 an *attaching*
``SharedMemory`` registers the segment with the resource tracker, which unlinks it when the
attaching process exits -- the owner's segment would vanish under it. Here only the creator ever
unlinks, explicitly on ``close()`` or from a finalizer (garbage collection or interpreter exit),
so a failing test still leaves nothing behind.

Why ``close()`` does not ``munmap``: ``torch.frombuffer`` tensors keep the mmap object alive but
do not pin its export count, so unmapping while a tensor view exists would turn every later access
of that tensor into a segfault. ``close()`` drops this object's references and unlinks the name;
the mapping itself goes away when the last tensor that views it is garbage-collected.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref
from collections.abc import Iterable

SHM_DIR = "/dev/shm"
NAME_PREFIX = "pdd-"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class SharedMemoryError(RuntimeError):
    """A shared-memory segment could not be created, attached or used."""


def segment_name(name: str) -> str:
    """Normalise a user-given name: validated, and prefixed with ``pdd-`` unless it already is."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SharedMemoryError(
            f"bad shared-memory name {name!r}: use 1-200 characters from [A-Za-z0-9._-], no '/'"
        )
    return name if name.startswith(NAME_PREFIX) else NAME_PREFIX + name


def unique_segment_name(tag: str = "kv") -> str:
    """A fresh ``pdd-<tag>-<pid>-<random>`` name, for pools that nobody needs to guess."""
    return segment_name(f"{tag}-{os.getpid()}-{secrets.token_hex(4)}")


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, segment_name(name))


def segments_of(pids: Iterable[int]) -> list[str]:
    """The pdd-* segments named after one of ``pids`` (``unique_segment_name`` embeds its
    creator's PID: pdd-<tag>-<pid>-<random>), sorted."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    marks = [f"-{pid}-" for pid in pids]
    return sorted(n for n in names if n.startswith(NAME_PREFIX) and any(m in n for m in marks))


def unlink_segment(name: str) -> None:
    """Remove a segment by its full name (as ``segments_of`` lists it), e.g. one whose creator
    died: nobody else ever will. Gone already is fine; processes mapping it keep their mapping."""
    if not name.startswith(NAME_PREFIX) or "/" in name:
        raise SharedMemoryError(f"not a pddnet shared-memory segment name: {name!r}")
    _unlink_quietly(os.path.join(SHM_DIR, name))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedSegment:
    """One mapped segment. ``create`` makes (and later unlinks) it; ``attach`` maps an existing one."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap: mmap.mmap | None = mm
        # The finalizer holds only the path, never self, so it does not keep the segment alive.
        self._finalizer = (
            weakref.finalize(self, _unlink_quietly, segment_path(name)) if owner else None
        )

    @classmethod
    def create(cls, name: str, size: int) -> SharedSegment:
        if size <= 0:
            raise SharedMemoryError(f"segment size must be positive, got {size}")
        if not os.path.isdir(SHM_DIR):
            raise SharedMemoryError(f"{SHM_DIR} is missing: POSIX shared memory is not available")
        full = segment_name(name)
        path = segment_path(full)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise SharedMemoryError(f"shared-memory segment {full!r} already exists") from None
        try:
            os.ftruncate(fd, size)
            try:
                # Commit the pages now: a full /dev/shm then fails here with a clear error
                # instead of a SIGBUS on some later write (a registered region is pinned anyway).
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise SharedMemoryError(
                    f"cannot reserve {size} bytes for {full!r} in {SHM_DIR}: {e.strerror}"
                ) from None
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink_quietly(path)
            raise
        finally:
            os.close(fd)
        return cls(full, mm, size, owner=True)

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        full = segment_name(name)
        path = segment_path(full)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise SharedMemoryError(f"no shared-memory segment named {full!r}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise SharedMemoryError(f"shared-memory segment {full!r} is empty")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(full, mm, size, owner=False)

    @property
    def buffer(self) -> mmap.mmap:
        if self._mmap is None:
            raise SharedMemoryError(f"shared-memory segment {self.name!r} is closed")
        return self._mmap

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Drop the mapping reference; the creator also unlinks the name. Idempotent."""
        self._mmap = None
        if self._finalizer is not None:
            self._finalizer()  # runs the unlink once; later calls are no-ops

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"SharedSegment({self.name!r}, {self.size} bytes, {role}{', closed' if self.closed else ''})"
