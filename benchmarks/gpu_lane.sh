#!/usr/bin/env bash
# The GPU lane, in one call on a machine with a GPU whose Python has jax (CUDA),
# optax, flax, equinox and orbax: the whole train step with QK-Clip and the
# per-tensor rules against their bare formulas, then the test suite on the GPU
# (JAX's own devices; the tests that need 8 skip). Missing wheels (marin-haliax
# and what it needs) may come in .whl/. Writes its tables and logs to $OUT.
#
#     OUT=/tmp/out bash benchmarks/gpu_lane.sh [BENCH_SECONDS] [TEST_SECONDS]
set -u
out=${OUT:-/tmp/gpu_lane}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c 'import jax, optax, flax; print("jax", jax.__version__, "optax",
optax.__version__, "flax", flax.__version__, jax.devices())'
timeout "${1:-270}" python3 benchmarks/bench_train_step.py \
  --rule qk_clip,adagc_bare,stable_spam_bare 2>&1 | tee "$out/train_step.md"
# Each test's outcome as it ends (-v), so that a run cut by its time limit
# still names its failures; float32 matmuls at full precision (the GPU's
# default, TF32, rounds a twin's forward pass at 1e-3).
CLIPAX_TEST_DEVICES=native XLA_PYTHON_CLIENT_PREALLOCATE=false \
  JAX_DEFAULT_MATMUL_PRECISION=highest \
  timeout "${2:-270}" python3 -m pytest -v -p no:cacheprovider -n 12 -rf \
  -o addopts="--doctest-modules" 2>&1 | tee "$out/tests.txt" \
  | grep -E "FAILED|ERROR|passed|failed" | tail -n 40
