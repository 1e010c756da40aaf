"""Channel-model and relay benchmark: see kvtransport.netem.bench for what it measures."""

import sys

from kvtransport.netem.bench import main

if __name__ == "__main__":
    sys.exit(main())
