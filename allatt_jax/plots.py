"""`python -m allatt_jax.plots`: runs allatt_jax/commands/plots.py."""
from allatt_jax.commands import plots

if __name__ == "__main__":
  plots.run()
