"""The old path of `meshdistill.core.fsutil`: the same module object (every name, and a patch of one, is shared)."""

import sys

from meshdistill.core import fsutil

sys.modules[__name__] = fsutil
