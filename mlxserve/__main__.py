"""`python -m mlxserve ...` runs the `mlxserve` command."""

import sys

from mlxserve.cli.main import main

sys.exit(main())
