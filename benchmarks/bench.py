"""``boost bench`` as a script: ``python benchmarks/bench.py --sizes tiny --steps 2 ...``.

The benchmark ships in the package (:mod:`boost_compiler.bench.suite`); see its docstring or
``boost bench --help``.
"""

from __future__ import annotations

from boost_compiler.bench.suite import main

if __name__ == "__main__":
    raise SystemExit(main())
