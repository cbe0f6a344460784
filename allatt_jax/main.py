"""`python -m allatt_jax.main`: runs allatt_jax/commands/main.py."""
from allatt_jax.commands import main

if __name__ == "__main__":
  main.run()
