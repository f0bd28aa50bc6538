"""The old path of `meshdistill.core.ownership`: the same module object (every name, and a patch of one, is shared)."""

import sys

from meshdistill.core import ownership

sys.modules[__name__] = ownership
