"""Benchmark scripts of the source checkout (``boost bench`` itself ships in the package).

- ``bench.py``: ``boost bench`` as a script (:mod:`boost_compiler.bench.suite`): communication,
  step time and GEMM throughput of BOOST vs torch's DTensor tensor parallelism.
- ``gemm.py``: the GEMM microbench (:mod:`boost_compiler.bench.gemm`), on its own.
- ``comm_per_layer.py``: per-layer communication (increment between two depths), eager.
- ``gpu.py`` / ``gpu.sh``: the prepared single-GPU run (fails fast without a GPU).
- ``checkpoint_modes.py``, ``passes_step_time.py``, ``detect_40b.py``, ``fuzz.py``: checkout-only
  measurements (they use ``tests/``).
"""
