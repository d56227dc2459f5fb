"""The measured benchmarks behind ``boost bench`` (they ship with the package).

- :mod:`.suite`: ``boost bench`` / ``python -m boost_compiler.bench``: communication, step
  time and GEMM throughput of BOOST vs torch's DTensor tensor parallelism, JSON + tables + PNG
  charts (matplotlib, optional: the ``[bench]`` extra).
- :mod:`.gemm`: the GEMM microbench (K = r/p vs K = d/p), also on its own
  (``python -m boost_compiler.bench.gemm``).
- :mod:`.harness`: shared helpers (the CoLA-LLaMA and its dense twin, torch's DTensor plans,
  gloo event counting, spawning worker processes).
- :mod:`.training`: one benchmarked training run, inside a spawned worker.
"""
