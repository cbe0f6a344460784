"""Experiments: heuristic pruners, and suites that reproduce the paper's tables.

  python -m allatt_jax.experiments --suite=lambda_sweep --config=configs/exp_chars.py \
      --workdir=/tmp/exp_chars

See `suites.py` for the suites, `runs.py` for how their runs are set up and reused,
`heuristics.py` for the pruners the L0 gates are compared with.
"""
