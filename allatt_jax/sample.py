r"""Generates text from a trained model with the Transformer-XL memory.

  python -m allatt_jax.sample --checkpoint=DIR [--step=N] --prompt="the history of" \
      --num_tokens=200 [--temperature=1.0 --top_k=0 --seed=0 --keep_unk]

DIR is a run's workdir (gated models use their deterministic gates) or an export. The
prompt fills the memory once; each new token is one step attending to the memory (the
eval mem_len) and itself. The same seed gives the same text. A word-level model never
samples <unk> unless --keep_unk.
"""
from absl import flags
from absl import logging

from allatt_jax.config import cli
from allatt_jax.config import errors
from allatt_jax.evaluation import generation
from allatt_jax.runs import trained_model

_CHECKPOINT, _STEP = cli.DEFINE_trained_model()
_PROMPT = flags.DEFINE_string("prompt", None, "Text the generation continues "
                              "(tokenised with the run's vocabulary).", required=True)
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 200, "How many tokens to generate.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "Divides the log-probabilities before sampling; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; "
                              "0 = all.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed: the same seed, the same text.")
_KEEP_UNK = flags.DEFINE_bool(
    "keep_unk", False, "Word level: let the model sample <unk> (by default it never "
    "does: <unk> stands for every rare word at once).")


def main(argv):
  del argv
  if _NUM_TOKENS.value < 0:
    raise errors.ConfigError(f"--num_tokens={_NUM_TOKENS.value}: use 0 or more.")
  model = trained_model.load(_CHECKPOINT.value, _STEP.value)
  result = generation.sample_text(model, _PROMPT.value, _NUM_TOKENS.value,
                                  temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                                  seed=_SEED.value, keep_unk=_KEEP_UNK.value)
  if result["skipped"]:
    what = ("words read as <unk>" if model.tokenizer.level == "word"
            else "characters dropped")
    logging.warning("Prompt tokens outside the vocabulary: %d (%s); the model reads "
                    "it as %r.", result["skipped"], what, result["prompt"])
  print(result["text"])


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv, flag_names={}, fallback_advice=trained_model.OLD_MODEL_ADVICE)


if __name__ == "__main__":
  run()
