#!/usr/bin/env bash
# The first thing a lent GPU runs: the split attention core's persistent parts and a
# layer's timings there, then the benchmark (allatt_jax/perf/gpu_check.py; docs/performance.md,
# "The device check"). Each piece runs in its own process under `timeout`.
#
#   launch/gpu_check.sh              # on the GPU: 9 minutes at most, the install included
#   launch/gpu_check.sh --dry-run    # on a CPU: the XLA parts at tiny shapes, the others' refusals
#
# Where $OUT is set (the folder whose files a lent GPU machine returns; nothing else
# comes back), the report goes there: gpu_check_DATE.json, its table gpu_check_DATE.md,
# the benchmark's report and log; it is rewritten after every piece, so a run stopped at
# its limit keeps the pieces that finished. Elsewhere: docs/bench/ and
# docs/performance.md (a dry run: a temporary folder).
#
# Arguments go to `python -m allatt_jax.perf.gpu_check`. PYTHON picks the interpreter
# (default python3); GPU_CHECK_SECONDS the whole script's limit (default 535 s, so
# that with `timeout`'s 5 s of grace it ends within 9 minutes). Wheels in .whl/
# (packages the machine lacks, e.g. ml_collections and clu for the benchmark's config
# on the accelerator image) are installed into /tmp/site first, within that limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
limit=${GPU_CHECK_SECONDS:-535}
start=$SECONDS
if compgen -G ".whl/*.whl" > /dev/null; then
  if timeout -k 5 $((limit / 4)) "$PYTHON" -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "gpu_check: the wheels in .whl/ installed in $((SECONDS - start)) s"
  else
    echo "gpu_check: the wheels in .whl/ did not install; the benchmark will say what it lacks" >&2
  fi
fi
export PYTHONUNBUFFERED=1
left=$((limit - (SECONDS - start)))
# The pieces keep to a budget 10 s short of what is left; `timeout` stops whatever
# outlives it all (SIGTERM: the piece in flight is recorded as stopped).
exec timeout -k 5 "$left" "$PYTHON" -m allatt_jax.perf.gpu_check --budget=$((left - 10)) "$@"
