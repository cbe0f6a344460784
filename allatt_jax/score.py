"""`python -m allatt_jax.score`: runs allatt_jax/commands/score.py."""
from allatt_jax.commands import score

if __name__ == "__main__":
  score.run()
