"""``python -m ringdilated``: the command line."""

import sys

from ringdilated.cli import main

sys.exit(main())
