"""The old path of `meshdistill.core.typed_yaml`: the same module object (every name, and a patch of one, is shared)."""

import sys

from meshdistill.core import typed_yaml

sys.modules[__name__] = typed_yaml
