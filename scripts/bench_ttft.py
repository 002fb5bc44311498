"""TTFT ratios pdd / same-dc and cross-dc / same-dc from one run (see pddnet/bench/ttft.py)."""

import sys

from pddnet.bench.ttft import main

if __name__ == "__main__":
    sys.exit(main())
