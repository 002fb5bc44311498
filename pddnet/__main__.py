import sys

from pddnet.cli import main

sys.exit(main())
