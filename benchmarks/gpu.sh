#!/usr/bin/env bash
# The prepared single-GPU run (see benchmarks/gpu.py): under 8 minutes on one GPU; exits with
# status 2 and a message at once on a machine without one.
#   bash benchmarks/gpu.sh --out "$OUT"
# Python: $PYTHON, else the repository's .venv, else python3 (a GPU image's torch).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # boost_compiler, benchmarks, examples
export PYTHONUNBUFFERED=1
exec timeout 480 "$py" benchmarks/gpu.py "$@"
