"""The old path of `meshdistill.losses.schedules`: the same module object (every name, and a patch of one, is shared)."""

import sys

from meshdistill.losses import schedules

sys.modules[__name__] = schedules
