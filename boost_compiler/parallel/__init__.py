"""The user-facing tensor-parallel layer: ``parallelize`` and the runtime of a parallelized model.

Above the compiler: it captures the model (:mod:`boost_compiler.ir`), plans it with the pass pipeline
(:mod:`boost_compiler.passes`, :mod:`boost_compiler.tp`), shards the parameters in place and keeps a shadow whose
forward the boost backend compiles. Nothing below this package imports it.
"""

# Registers how the backend compiles a parallelized model's graphs: every placeholder comes
# from this package, so the backend finds the runtime whenever it meets one.
from . import runtime as _runtime  # noqa: F401
