"""`python -m tuner`: the same as `ferry tune`."""

import sys

from .cli import main

sys.exit(main())
