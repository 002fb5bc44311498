"""WAN KV bytes and TTFT with and without the decode-side RadixCache (see pddnet/bench/drc.py).

python scripts/bench_drc.py [--quick]      (same as: pdd bench drc [--quick])
"""

import sys

from pddnet.bench.cli import BENCHES, run_spec

if __name__ == "__main__":
    sys.exit(run_spec(BENCHES["drc"], sys.argv[1:]))
