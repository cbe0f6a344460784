"""`python -m allatt_jax.benchmark`: runs allatt_jax/commands/benchmark.py."""
from allatt_jax.commands import benchmark

if __name__ == "__main__":
  benchmark.run()
