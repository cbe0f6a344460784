"""`python -m allatt_jax.export`: runs allatt_jax/commands/export.py."""
from allatt_jax.commands import export

if __name__ == "__main__":
  export.run()
