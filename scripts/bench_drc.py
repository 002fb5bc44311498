"""WAN KV bytes and TTFT with and without the decode-side RadixCache (see pddnet/bench/drc.py).

python scripts/bench_drc.py [--quick]      (same as: pdd bench drc [--quick])
"""

import sys

from pddnet.bench.drc import main

if __name__ == "__main__":
    sys.exit(main())
