#!/usr/bin/env bash
# Set-up and run in one command, on a fresh machine or an existing checkout.
#
#   bash dev.sh demo [args]   # the main job: examples/demo.py [args], then demo_tp.py on 2 ranks
#   bash dev.sh test [args]   # the test suite (pytest)
#   bash dev.sh compat [args] # the compatibility tier: the newest supported torch and
#                             # transformers (+ kernels) in ./.venv-compat, a smoke set
#
# Creates ./.venv (or $BOOST_VENV), installs torch only if that environment has
# none (the CPU wheel pinned by $BOOST_TORCH, default torch==2.13.0; GPU users
# install their own torch build into the venv first), then this package.
# `compat` does the same in ./.venv-compat ($BOOST_COMPAT_VENV) with $BOOST_COMPAT_TORCH
# (default torch==2.15.0, PyPI's default build: several GB with its CUDA libraries,
# it runs on CPU) and transformers 5.25 with the kernels package, the newest releases
# pyproject admits; CI runs it after `test` (.ci/run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

VENV=${BOOST_VENV:-.venv}
TORCH_SPEC=${BOOST_TORCH:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
PINS=""  # installed with the package (compat: the newest transformers, kernels)
if [ "${1:-}" = compat ]; then
  VENV=${BOOST_COMPAT_VENV:-.venv-compat}
  TORCH_SPEC=${BOOST_COMPAT_TORCH:-torch==2.15.0}
  PINS="transformers==5.25.0 kernels"
  # A machine-wide pip config may cap torch (a constraints file, as on the CI image,
  # torch<=2.14.1): it would refuse, or later downgrade, the newest torch. Ignored for
  # this venv's installs only (they come from PyPI); the default tier keeps it.
  export PIP_CONFIG_FILE=/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "dev.sh: Python >= 3.11 is needed ($PYTHON is $($PYTHON -V 2>&1))" >&2; exit 1; }
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# pip's warnings about this machine's local package folders are noise; errors still show.
pip_quiet() {
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v '^WARNING: Location' >&2)
}

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "dev.sh: installing $TORCH_SPEC into $VENV" >&2
  pip_quiet "$TORCH_SPEC"
fi
# Every extra the test suite uses: with BOOST_REQUIRE_EXTRAS=1 (below) a missing one
# fails its tests instead of skipping them (tests/extras.py).
EXTRAS="test,hf,train,bench,draw,tensorboard"
# Reinstall the package only when its metadata or the extras changed (editable install).
stamp="$VENV/.boost-installed"
want=$( (cat pyproject.toml; echo "$EXTRAS $PINS") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # shellcheck disable=SC2086  # PINS: separate requirements
  pip_quiet -e ".[$EXTRAS]" $PINS
  "$PY" -c 'import boost_compiler' && echo "$want" > "$stamp"
fi

# The compat tier's smoke set (bash dev.sh compat [test ids] runs others instead).
# backend + Inductor lowering, passes on one process, capture of a checkpointed HF model
# with kernels, compiled tp=2 (every default pass, post-grad waits), Inductor's private
# collective config (symm_mem), and pp=2 -> FSDP2 dp=2 x tp=2 -> one process through DCP.
COMPAT_SMOKE=(
  tests/test_backend.py
  tests/test_passes.py
  tests/test_regions.py::test_checkpointed_hf_model_with_kernels_is_captured
  tests/test_poll_waits.py
  tests/test_symm_mem.py
  tests/test_pipeline_resume.py::test_checkpoint_of_a_pipeline_holds_one_model
  tests/test_pipeline_resume.py::test_resume_across_layouts_matches_one_process
)

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    "$PY" examples/demo.py "$@"
    OMP_NUM_THREADS=1 exec "$VENV/bin/torchrun" --standalone --nproc-per-node 2 examples/demo_tp.py ;;
  test)
    # A new test order every run (pytest-randomly), printed so that a failure replays:
    # BOOST_TEST_SEED=N (or -p no:randomly for the file order).
    seed=${BOOST_TEST_SEED:-$(( $(date +%s) % 100000 ))}
    echo "dev.sh: test order seed $seed (replay: BOOST_TEST_SEED=$seed bash dev.sh test)"
    BOOST_REQUIRE_EXTRAS=1 exec "$PY" -m pytest -q -p randomly --randomly-seed="$seed" "$@" ;;
  compat)
    # A smoke set across capture, planning, every pass, Inductor lowering, FSDP2, DCP and
    # pipelining, and the gradient-checkpointed HF model with kernels (test_regions.py),
    # on the newest releases; fixed order. Measured on 2 cores: see docs/setup.md.
    "$PY" -c 'import torch, transformers, kernels; print("dev.sh compat: torch",
      torch.__version__, "transformers", transformers.__version__, "kernels", kernels.__version__)'
    [ $# -gt 0 ] || set -- "${COMPAT_SMOKE[@]}"
    BOOST_REQUIRE_EXTRAS=1 exec "$PY" -m pytest -q -p no:randomly "$@" ;;
  *) echo "usage: bash dev.sh demo|test|compat [args]" >&2; exit 2 ;;
esac
