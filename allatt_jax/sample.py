"""`python -m allatt_jax.sample`: runs allatt_jax/commands/sample.py."""
from allatt_jax.commands import sample

if __name__ == "__main__":
  sample.run()
