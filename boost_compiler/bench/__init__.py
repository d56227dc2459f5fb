"""The measured benchmarks behind ``boost bench`` (they ship with the package).

- :mod:`.suite`: ``boost bench`` / ``python -m boost_compiler.bench``: communication, step
  time and GEMM throughput of BOOST vs torch's DTensor tensor parallelism, JSON + tables + PNG
  charts (matplotlib, optional: the ``[bench]`` extra).
- :mod:`.gemm`: the GEMM microbench (K = r/p vs K = d/p), also on its own
  (``python -m boost_compiler.bench.gemm``).
- :mod:`.harness`: shared helpers (the CoLA-LLaMA and its dense twin, gloo event counting,
  spawning worker processes) and the previous DTensor plans (``-nosp``).
- :mod:`.peers`: torch DTensor TP in the plans torchtitan runs for LLaMA (sequence-parallel
  norms, vocabulary-parallel head under ``loss_parallel``), per-block compiled, and their
  communication by formula: the baselines every ratio is measured against.
- :mod:`.training`: one benchmarked training run, inside a spawned worker.
- :mod:`.analysis`, :mod:`.report`, :mod:`.charts`: sizes and predictions, the tables, the PNGs.
"""
