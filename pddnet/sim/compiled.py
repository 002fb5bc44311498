"""The simulator compiled to C with mypyc: the same source, ~1.8x faster, byte-identical results.

The simulation's hot path (the event loop, the simulated instances and WAN, the emulator's link
model, the KV radix tree and allocator, P's cache view and the pipeline / handoff policies) is
plain typed Python; mypyc turns each of those modules into a C extension with the same
behaviour. The installed package stays pure Python (the daemons and the tests use it); this
module builds a *compiled copy* of the package sources in a cache folder, keyed by a digest of
the sources as compiled (each compiled module's dataclasses get their ``__init__`` written out
by pddnet/sim/compile_shape.py, so mypyc compiles it too), the interpreter and mypyc's
version, and runs the simulator from there:

    pdd sim run --config FILE --compiled          (builds once, ~1 min; then re-executes)
    python -m pddnet.sim.compiled build           (just build; prints the folder)

A module that does not compile (a type error mypyc rejects) fails the build with mypyc's
message: the simulator never silently runs half compiled. ``tests/test_sim_compiled.py`` runs a
scenario both ways and compares the JSON byte for byte.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from pddnet.sim.compile_shape import shape_source

# What is compiled: the modules a simulation spends its time in. Not here: config parsing,
# reporting and plots (run once per simulation).
COMPILED_MODULES: tuple[str, ...] = (
    "emulation.effects",
    "emulation.link",
    "pddnet.device.cost",
    "pddnet.kv.allocator",
    "pddnet.kv.block_hash",
    "pddnet.kv.cache_events",
    "pddnet.kv.hit_histogram",
    "pddnet.kv.prefix_cache",
    "pddnet.kv.radix",
    "pddnet.kv.radix_node",
    "pddnet.kv.radix_tree",
    "pddnet.policy.admission",
    "pddnet.policy.cache_view",
    "pddnet.policy.estimators",
    "pddnet.policy.handoff",
    "pddnet.policy.pipeline",
    "pddnet.policy.planner",
    "pddnet.sim.decode",
    "pddnet.sim.events",
    "pddnet.sim.handoff",
    "pddnet.sim.metrics",
    "pddnet.sim.prefill",
    "pddnet.sim.runner",
    "pddnet.sim.system",
    "pddnet.sim.wan",
    "pddnet.workload.agent",
    "pddnet.workload.agent_stream",
    "pddnet.workload.trace",
    "pddnet.workload.units",
)
PACKAGES = ("pddnet", "emulation")  # copied whole: the compiled copy is self-contained
TREE_ENV = "PDDNET_COMPILED_TREE"  # set in a process re-executed on the copy
CACHE_ENV = "PDDNET_COMPILED_CACHE"  # where copies are kept (default ~/.cache/pddnet)


class CompileError(RuntimeError):
    """mypyc (or the C compiler) failed; the message carries the tail of its output."""


def source_root() -> Path:
    """The folder holding the ``pddnet`` and ``emulation`` packages this process imported."""
    import pddnet

    return Path(pddnet.__file__).resolve().parents[1]


def _sources(root: Path) -> list[Path]:
    out: list[Path] = []
    for pkg in PACKAGES:
        out += sorted(
            p
            for p in (root / pkg).rglob("*")
            if p.is_file()
            and "__pycache__" not in p.parts
            and p.suffix not in (".so", ".pyc", ".pyd")
        )
    return out


def _compiled_files() -> list[Path]:
    """COMPILED_MODULES as paths relative to the source root."""
    return [Path(*m.split(".")).with_suffix(".py") for m in COMPILED_MODULES]


def _tree_text(root: Path) -> dict[Path, bytes]:
    """What the compiled copy holds, by path relative to ``root``: every source file, the
    compiled modules shaped for mypyc (their dataclasses' ``__init__`` written out)."""
    shaped = set(_compiled_files())
    out: dict[Path, bytes] = {}
    for p in _sources(root):
        rel = p.relative_to(root)
        data = p.read_bytes()
        out[rel] = shape_source(data.decode()).encode() if rel in shaped else data
    return out


def opt_level() -> str:
    """The C compiler's optimisation level mypyc builds with: $MYPYC_OPT_LEVEL, which mypyc
    itself reads (default 3). The tests build at 0, in half the time: they compare results,
    not speed, and a copy built so is kept apart from the fast one (the level is in the digest)."""
    return os.environ.get("MYPYC_OPT_LEVEL", "3")


def groups() -> int:
    """How many C libraries mypyc builds the modules into. One is the fastest simulator (a
    call into the other group costs: ~15% more CPU per run, measured at -O0). The tests' -O0
    copy, built for comparing results, takes two of about equal size: they compile side by
    side (setuptools' build_ext -j), ~35% less wall time on two cores."""
    return 2 if opt_level() == "0" else 1


def digest(root: Path | None = None, text: dict[Path, bytes] | None = None) -> str:
    """Names the compiled copy: the package sources as they are compiled (``text``, else
    shaped from ``root``), the interpreter, mypyc's version, optimisation level and groups."""
    if text is None:
        text = _tree_text(root or source_root())
    h = hashlib.sha256()
    h.update(sys.version.encode())
    h.update(_mypyc_version().encode())
    h.update(f"-O{opt_level()} groups={groups()}".encode())
    for rel, data in text.items():
        h.update(str(rel).encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


def _mypyc_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        return "none"
    return __version__


def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV)
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pddnet" / "compiled"


def missing_tools() -> str | None:
    """Why a build cannot run here (None: it can): mypyc and a C compiler are needed."""
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (pip install mypy)"
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")):
        return "no C compiler (cc / gcc) on PATH"
    return None


def build(cache: Path | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The compiled copy's folder (put it first on PYTHONPATH), built unless it exists."""
    root = source_root()
    text = _tree_text(root)
    tree = (cache or cache_dir()) / digest(text=text)
    if (tree / ".complete").exists():
        return tree
    why = missing_tools()
    if why:
        raise CompileError(f"cannot compile the simulator: {why}")
    tree.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=tree.name + ".", dir=tree.parent))
    try:
        for rel, data in text.items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_bytes(data)
        files = [str(f) for f in _compiled_files()]
        if log:
            log(
                f"compiling {len(files)} simulator modules with mypyc into {tree} "
                f"(once per source version; ~1 min)"
            )
        env = dict(os.environ, MYPY_CACHE_DIR=str(work / ".mypy_cache"))
        setup = work / "build" / "setup.py"  # what `python -m mypyc FILES` writes, in groups
        setup.parent.mkdir()
        setup.write_text(_SETUP.format(groups=_split(work, files, groups()), opt=opt_level()))
        proc = subprocess.run(
            [sys.executable, str(setup), "build_ext", "--inplace", "-j", str(groups())],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.strip().splitlines()[-30:])
            raise CompileError(f"mypyc failed (exit {proc.returncode}):\n{tail}")
        shutil.rmtree(work / "build", ignore_errors=True)
        shutil.rmtree(work / ".mypy_cache", ignore_errors=True)
        (work / ".complete").write_text(" ".join(COMPILED_MODULES) + "\n")
        try:
            work.rename(tree)
        except OSError:  # another process finished the same build first
            if not (tree / ".complete").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tree


_SETUP = """\
from setuptools import setup
from mypyc.build import mypycify

groups = {groups!r}
setup(
    name="pddnet_compiled",
    ext_modules=mypycify(
        [f for g in groups for f in g], separate=[(g, None) for g in groups], opt_level={opt!r}
    ),
)
"""


def _split(work: Path, files: list[str], n: int) -> list[list[str]]:
    """``files`` in ``n`` groups of about equal source size: the largest file first, each
    into the group that is smallest so far."""
    out: list[list[str]] = [[] for _ in range(n)]
    sizes = [0] * n
    for f in sorted(files, key=lambda f: (-(work / f).stat().st_size, f)):
        i = sizes.index(min(sizes))
        out[i].append(f)
        sizes[i] += (work / f).stat().st_size
    return out


def compiled_modules() -> list[str]:
    """Which of COMPILED_MODULES this process loads as C extensions (imports them)."""
    out = []
    for name in COMPILED_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            out.append(name)
    return out


def describe() -> str:
    """One line for a benchmark's or a run's header: how this process runs the simulator."""
    done = compiled_modules()
    if not done:
        return "simulator: pure Python"
    return f"simulator: compiled with mypyc ({len(done)} of {len(COMPILED_MODULES)} modules)"


def compiled_env(tree: Path) -> dict[str, str]:
    """This process's environment, with Python importing the package from the compiled copy."""
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(tree) + (os.pathsep + old if old else "")
    env[TREE_ENV] = str(tree)
    return env


# `python -m pddnet` would put the working directory first on sys.path, ahead of PYTHONPATH:
# run from a checkout, it would import the pure package. So the copy goes first explicitly
# (spawned --jobs workers inherit sys.path).
_BOOT = (
    "import sys, runpy; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('pddnet', run_name='__main__', alter_sys=True)"
)


def reexec(argv: Sequence[str], log: Callable[[str], None] | None = None) -> None:
    """Replace this process by ``pdd <argv>`` running on the compiled copy (builds it
    first). Raises CompileError when it cannot be built."""
    tree = build(log=log)
    os.execve(sys.executable, [sys.executable, "-c", _BOOT, str(tree), *argv], compiled_env(tree))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m pddnet.sim.compiled", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "command",
        choices=["build", "where"],
        help="build: compile (if needed) and print the folder; where: print it",
    )
    args = ap.parse_args(argv)
    if args.command == "where":
        print(cache_dir() / digest())
        return 0
    try:
        print(build(log=lambda s: print(s, file=sys.stderr)))
    except CompileError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
