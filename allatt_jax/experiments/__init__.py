r"""Experiments: heuristic pruners, and suites that reproduce the paper's tables.

  python -m allatt_jax.experiments --suite=lambda_sweep --config=configs/exp_chars.py \
      --workdir=/tmp/exp_chars
"""
