"""`python -m allatt_jax.evaluate`: runs allatt_jax/commands/evaluate.py."""
from allatt_jax.commands import evaluate

if __name__ == "__main__":
  evaluate.run()
