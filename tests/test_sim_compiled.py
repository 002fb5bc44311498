"""The simulator compiled with mypyc (pddnet/sim/compiled.py) gives byte for byte what the
pure-Python package gives, and really runs compiled.

The build takes ~1 min on one core the first time; it is cached by a digest of the sources
(in ~/.cache/pddnet/compiled, or $PDDNET_COMPILED_CACHE), so later runs reuse it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pddnet.sim import compiled
from tests.run_module import run_module
from tests.test_sim_system import small_dict, write_conversation_trace

pytestmark = [
    pytest.mark.skipif(
        compiled.missing_tools() is not None,
        reason=f"cannot compile here: {compiled.missing_tools()}",
    ),
    # the first test builds the copy: mypyc takes minutes on a loaded machine, beyond the
    # suite's default 180 s (a built copy is cached: later runs take seconds)
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module", autouse=True)
def quick_build():
    """Build at -O0 (about half the time of mypyc's -O3; these tests compare results, and the
    level is part of the copy's digest, so a user's fast copy is never this one). The CLI runs
    below inherit it."""
    old = os.environ.get("MYPYC_OPT_LEVEL")
    os.environ["MYPYC_OPT_LEVEL"] = "0"
    yield
    if old is None:
        del os.environ["MYPYC_OPT_LEVEL"]
    else:
        os.environ["MYPYC_OPT_LEVEL"] = old


@pytest.fixture(scope="module")
def tree(quick_build) -> Path:
    return compiled.build(log=print)


def _pdd(args, env=None):
    return run_module("pddnet", *args, env=env, check=True, timeout=600)


def test_the_compiled_copy_imports_every_listed_module_as_a_c_extension(tree):
    code = (
        "from pddnet.sim import compiled; import pddnet; "
        "print(compiled.compiled_modules() == list(compiled.COMPILED_MODULES)); "
        "print(pddnet.__file__)"
    )
    # (from a folder without the pure package: Python puts the working directory first)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=compiled.compiled_env(tree),
        cwd=tree.parent,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.split()
    assert out[0] == "True"
    assert Path(out[1]).is_relative_to(tree)
    # and this (the tests') process runs the pure package
    assert compiled.compiled_modules() == []
    assert compiled.build() == tree  # cached: the same digest, no second build


def _stressful_config(path: Path, trace: Path) -> None:
    """Every system, a jittery line with a small queue (queue_mb = 8), instances with a
    quarter of their memory (MD short of blocks: allocations wait), and a second workload
    replayed from a trace file."""
    write_conversation_trace(
        trace,
        120,
        turns=6,
        prefix=30,
        growth=5,
        gap_ms=150,
        block=256,
        output_length=lambda i: 64 + 13 * (i % 9),
    )
    base = small_dict(
        220,
        seed=11,
        tokens_per_unit=256,
        systems=["same-dc", "cross-dc", "pdd", "pdd-no-drc", "cross-dc-no-drc"],
        line={"bw_gbit": 5, "rtt_ms": 40, "jitter_ms": 6, "queue_mb": 8},
        engine={"memory_utilisation": 0.25},
    )
    base["workload"].update(num_conversations=400, conversation_rate_per_s=1.0)
    path.write_text(json.dumps(base))
    traced = dict(
        base,
        workload={"kind": "trace", "path": str(trace), "requests": 120},
        systems=["pdd", "cross-dc"],
    )
    (path.parent / "traced.json").write_text(json.dumps(traced))


def test_compiled_and_pure_runs_give_byte_identical_json(tree, tmp_path):
    cfg, trace = tmp_path / "stress.json", tmp_path / "trace.jsonl"
    _stressful_config(cfg, trace)
    env = dict(os.environ)
    env.pop(compiled.TREE_ENV, None)
    for name in ("stress", "traced"):
        for mode in ("pure", "compiled"):
            args = [
                "sim",
                "run",
                "--config",
                str(tmp_path / f"{name}.json"),
                "--no-plots",
                "--jobs",
                "1",
                "--out",
                str(tmp_path / mode),
            ]
            run = _pdd(args + (["--compiled"] if mode == "compiled" else []), env=env)
            want = (
                "simulator: compiled with mypyc" if mode == "compiled" else "simulator: pure Python"
            )
            assert want in run.stderr
        pure = (tmp_path / "pure" / f"{name}.json").read_text()
        fast = (tmp_path / "compiled" / f"{name}.json").read_text()
        systems = json.loads(pure)["systems"]  # a real result, not an empty file
        assert all(r["finished"] == r["requests"] for r in systems.values())
        if name == "stress":  # the config does what it says
            assert systems["pdd"]["md_alloc_waits"] > 0
        assert pure == fast, f"{name}: compiled and pure JSON differ"


@pytest.mark.heavy  # CI: the stressful scenarios above cover every system compiled vs pure
def test_reproduce_quick_compiled_is_byte_identical_to_pure(tree, tmp_path):
    for mode in ("pure", "compiled"):
        _pdd(
            [
                "sim",
                "reproduce",
                "--quick",
                "--no-plots",
                "--jobs",
                "2",
                "--out",
                str(tmp_path / mode),
            ]
            + (["--compiled"] if mode == "compiled" else [])
        )
    assert (tmp_path / "pure" / "reproduce-quick.json").read_text() == (
        tmp_path / "compiled" / "reproduce-quick.json"
    ).read_text()


def test_a_build_that_cannot_compile_fails_with_mypycs_message(tmp_path, monkeypatch):
    # a copy of the sources with a type error mypyc rejects in one compiled module
    src = tmp_path / "src"
    for pkg in compiled.PACKAGES:
        shutil.copytree(
            compiled.source_root() / pkg,
            src / pkg,
            ignore=shutil.ignore_patterns("__pycache__", "*.so"),
        )
    events = src / "pddnet" / "sim" / "events.py"
    events.write_text(events.read_text() + "\n\ndef _broken() -> int:\n    return 'not an int'\n")
    monkeypatch.setattr(compiled, "source_root", lambda: src)
    with pytest.raises(
        compiled.CompileError, match="events.py:[0-9]+: error: Incompatible return value"
    ):
        compiled.build(cache=tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())  # nothing half built is left behind
