"""Independent simulations in several processes give exactly what one process gives."""

import dataclasses

import pytest

from pddnet.cli import main
from pddnet.sim.cli import dumps
from pddnet.sim.parallel import Task, run_tasks
from pddnet.sim.runner import run_systems
from tests.test_sim_system import small


def paced(requests=150):
    """test_sim_system's small config, every system offered the baseline's send times."""
    cfg = small(requests, seed=5, systems=["pdd", "same-dc", "cross-dc"])
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, arrivals="baseline"))


def test_two_processes_give_byte_identical_results_and_the_same_progress():
    cfg = paced()
    counts = {1: {}, 2: {}}
    out = {}
    for jobs in (1, 2):

        def progress(system, n, seen=counts[jobs]):
            seen[system] = seen.get(system, 0) + n

        out[jobs] = run_systems(cfg, cfg.systems, progress, jobs=jobs)
    assert dumps(out[1]) == dumps(out[2])
    assert tuple(out[2]) == tuple(cfg.systems)  # the config's order, not completion order
    assert counts[1] == counts[2] == dict.fromkeys(cfg.systems, cfg.workload.requests)
    # the non-baseline systems were offered the baseline's recorded send times
    assert out[2]["pdd"]["offered_rps"] == out[2]["same-dc"]["offered_rps"]


def _fails(x):
    raise ValueError(f"bad input {x}")


def _progress_then(x, progress=None):
    progress("line")
    for _ in range(x):
        progress(1)
    return x * 10


def test_a_task_error_reaches_the_caller_and_results_keep_their_order():
    got = []
    res = run_tasks(
        [Task(_progress_then, (n,), progress_kw="progress") for n in (3, 1, 2)],
        jobs=2,
        progress=lambda i, p: got.append((i, p)),
    )
    assert res == [30, 10, 20]
    for i, n in enumerate((3, 1, 2)):
        mine = [p for j, p in got if j == i]
        assert mine[0] == "line" and sum(p for p in mine[1:]) == n
    with pytest.raises(ValueError, match="bad input 7"):
        run_tasks([Task(_progress_then, (1,), progress_kw="progress"), Task(_fails, (7,))], jobs=2)
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        run_tasks([Task(_fails, (1,))], jobs=0)


def test_the_cli_refuses_a_bad_jobs_count(tmp_path, capsys):
    assert main(["sim", "reproduce", "--quick", "--jobs", "0", "--out", str(tmp_path)]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
