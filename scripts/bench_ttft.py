"""TTFT ratios pdd / same-dc and cross-dc / same-dc from one run (see pddnet/bench/ttft.py)."""

import sys

from pddnet.bench.cli import BENCHES, run_spec

if __name__ == "__main__":
    sys.exit(run_spec(BENCHES["ttft"], sys.argv[1:]))
