"""The command-line programs: each module parses its flags and calls the library.

Each runs as `python -m allatt_jax.NAME` (through the module of that name beside the
library, which only starts it) or `python -m allatt_jax NAME`; `python -m
allatt_jax.data` and `python -m allatt_jax.experiments` live in their packages.
"""
