"""``python -m runtimes.cli``: the ``vf-sandbox`` command."""

import sys

from .app import main

sys.exit(main())
