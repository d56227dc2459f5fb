"""Benchmarks of boost-compiler (a source-checkout package, not installed with the wheel).

- ``bench.py``: ``boost bench`` / ``python benchmarks/bench.py``: communication, step time and
  GEMM throughput of BOOST vs torch's DTensor tensor parallelism, JSON + table + PNG charts.
- ``comm_per_layer.py``: per-layer communication (increment between two depths), eager.
- ``gemm.py``: the GEMM microbench (K = r/p vs K = d/p), also on its own.
- ``gpu.py`` / ``gpu.sh``: the prepared single-GPU run (fails fast without a GPU).
- ``_profile.py``: shared helpers (models, DTensor plans, gloo event counting, spawning).
"""
