"""`python -m allatt_jax.costs`: runs allatt_jax/commands/costs.py."""
from allatt_jax.commands import costs

if __name__ == "__main__":
  costs.run()
