"""The GEMM microbench as a script: ``python benchmarks/gemm.py [--scales 7b --tp 4 ...]``.

It ships in the package (:mod:`boost_compiler.bench.gemm`, also run by ``boost bench``).
"""

from __future__ import annotations

from boost_compiler.bench.gemm import main

if __name__ == "__main__":
    raise SystemExit(main())
