r"""Regenerates the demo's outputs quoted in README.md from a finished demo workdir.

  python -m allatt_jax.readme_examples --workdir=/tmp/allatt_demo [--readme=README.md]

Rewrites what lies between `<!-- generated:NAME -->` and `<!-- end:NAME -->` (NAME:
demo, score, sample) from the workdir, so the README's numbers are one demo run's.
"""
import pathlib

from absl import flags

from allatt_jax.config import cli
from allatt_jax.config import errors
from allatt_jax.reports import readme_blocks

_WORKDIR = flags.DEFINE_string("workdir", None, "A finished demo workdir "
                               "(python -m allatt_jax.main --config=configs/demo.py).")
_README = flags.DEFINE_string("readme", "README.md", "The README to rewrite.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv   # cli.run refuses extra arguments
  readme = pathlib.Path(_README.value)
  if not readme.is_file():
    raise errors.ConfigError(f"--readme={readme}: no such file.")
  readme.write_text(readme_blocks.rewrite_blocks(
      readme.read_text(), readme_blocks.generated_blocks(_WORKDIR.value)))
  print(f"Rewrote the generated blocks of {readme} from {_WORKDIR.value}")


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
