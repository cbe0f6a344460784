#!/usr/bin/env bash
# The first thing a lent GPU runs: the split attention core's persistent parts and a
# layer's timings there, then the benchmark (allatt_jax/perf/gpu_check.py; docs/performance.md,
# "The device check"). Each piece runs in its own process under `timeout`.
#
#   launch/gpu_check.sh              # on the GPU, within 9 minutes
#   launch/gpu_check.sh --dry-run    # on a CPU: the XLA parts at tiny shapes
#
# Arguments go to `python -m allatt_jax.perf.gpu_check`. PYTHON picks the interpreter
# (default python3). Wheels in .whl/ (packages the machine lacks, e.g. ml_collections
# and clu for the benchmark's config on the accelerator image) are installed into
# /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
# The pieces keep to the script's 525 s budget; this stops whatever outlives 9 minutes.
exec timeout -k 5 535 "$PYTHON" -m allatt_jax.perf.gpu_check "$@"
