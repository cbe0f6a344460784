"""`python -m allatt_jax.compile_check`: runs allatt_jax/commands/compile_check.py."""
from allatt_jax.commands import compile_check

if __name__ == "__main__":
  compile_check.run()
