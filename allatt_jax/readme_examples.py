r"""Regenerates the demo's outputs quoted in README.md and docs/commands.md from a
finished demo workdir.

  python -m allatt_jax.readme_examples --workdir=/tmp/allatt_demo [--root=.]

Rewrites what lies between `<!-- generated:NAME -->` and `<!-- end:NAME -->` (NAME:
demo, score, sample) from the workdir, so the docs' numbers are one demo run's.
"""
from absl import flags

from allatt_jax.config import cli
from allatt_jax.reports import readme_blocks

_WORKDIR = flags.DEFINE_string("workdir", None, "A finished demo workdir "
                               "(python -m allatt_jax.main --config=configs/demo.py).")
_ROOT = flags.DEFINE_string("root", ".", "The repository's root, whose README.md and "
                            "docs/commands.md quote the demo's outputs.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv   # cli.run refuses extra arguments
  texts = readme_blocks.read_quoting_files(_ROOT.value)   # before the models load
  blocks = readme_blocks.generated_blocks(_WORKDIR.value)
  for path, text in texts.items():
    path.write_text(readme_blocks.rewrite_blocks(text, blocks))
  print(f"Rewrote the generated blocks of {', '.join(map(str, texts))} from "
        f"{_WORKDIR.value}")


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
