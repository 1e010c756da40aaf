import sys

from kvtransport.cli import main

sys.exit(main())
