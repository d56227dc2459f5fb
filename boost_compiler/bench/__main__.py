"""``python -m boost_compiler.bench``: the same as ``boost bench``."""

from .suite import main

if __name__ == "__main__":  # not in spawned workers, which re-import the main module
    raise SystemExit(main())
