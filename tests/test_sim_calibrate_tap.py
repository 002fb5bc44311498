"""The calibration's per-tag tap (pddnet.sim.calibrate_replay.tagged_system_class) counts
every ITL gap and TTFT the simulator does, on a jittery line with handoffs and cuts."""

import sys
from pathlib import Path

import pytest

from pddnet.sim import runner
from pddnet.sim.calibrate_replay import tagged_system_class

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_system import small  # noqa: E402


def test_the_tap_files_every_gap_under_a_tag(monkeypatch):
    cfg = small(requests=120, line={"bw_gbit": 10, "rtt_ms": 30, "jitter_ms": 2.0})
    tags = ["fit" if i % 3 else "compare" for i in range(cfg.workload.requests)]
    system_cls, hists = tagged_system_class(tags)
    captured = {}
    original = runner.report

    def capture(sim):
        captured["sim"] = sim
        return original(sim)

    monkeypatch.setattr(runner, "SimulatedSystem", system_cls)
    monkeypatch.setattr(runner, "report", capture)
    rep = runner.simulate(cfg, "pdd")
    sim = captured["sim"]
    assert sum(rep["handoffs"].values()) > 0  # RLD cut some requests over to MD
    assert sim.itl.n > 1000
    assert sum(h["itl"].n for h in hists.values()) == sim.itl.n
    assert sum(h["itl"].total for h in hists.values()) == pytest.approx(sim.itl.total, rel=1e-9)
    assert sum(h["ttft"].n for h in hists.values()) == sim.ttft.n
    assert all(h["itl"].n > 0 for h in hists.values())
