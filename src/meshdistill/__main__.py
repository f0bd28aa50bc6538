"""``python -m meshdistill`` runs the ``meshdistill`` command."""

import sys

from meshdistill.cli import main

sys.exit(main())
