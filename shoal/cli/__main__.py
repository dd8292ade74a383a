"""`python -m shoal.cli`: the `shoal` command without its console script."""

import sys

from shoal.cli import main

sys.exit(main())
