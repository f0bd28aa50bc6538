"""``meshdistill plan``: compile the real distillation step for a TPU slice (or CPU devices) without the hardware.

>>> import meshdistill as md
>>> p = md.plan("llama3.1-8b", "llama3.2-1b", topology="v5e:4x4", batch=16, seq=2048)  # doctest: +SKIP
>>> print(p.table())                                                                     # doctest: +SKIP

Every array is abstract (`jax.ShapeDtypeStruct` with its sharding), so a 70 B teacher plans on a
laptop. The step is the `meshdistill.Distiller`'s own (see `_compile.abstract_distiller`); the
report gives per-device memory by kind against the chip's HBM, compiled and analytic FLOPs,
collectives by kind and mesh axis, a roofline step time and MFU, and the compile time.
"""

from meshdistill.core.chips import TPU_CHIPS, Chip, chip_of_kind
from meshdistill.planner._hardware import Target, cpu_count_of, libtpu_available, parse_target
from meshdistill.planner._entry import make_planner, plan, search
from meshdistill.planner._plan import Knobs, Planner
from meshdistill.planner._presets import PRESETS, resolve_model
from meshdistill.planner._report import Plan, search_table

__all__ = [
    "Chip",
    "chip_of_kind",
    "cpu_count_of",
    "Knobs",
    "libtpu_available",
    "make_planner",
    "parse_target",
    "Plan",
    "plan",
    "Planner",
    "PRESETS",
    "resolve_model",
    "search",
    "search_table",
    "Target",
    "TPU_CHIPS",
]
