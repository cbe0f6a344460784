"""`python -m allatt_jax.readme_examples`: runs allatt_jax/commands/readme_examples.py."""
from allatt_jax.commands import readme_examples

if __name__ == "__main__":
  readme_examples.run()
