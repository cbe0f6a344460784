"""Draws a pruning run's gates: each head's open probability at every logged step, and
the heads its export keeps.

  python -m allatt_jax.plots --workdir=RUN [--out=FILE.png]

The figure is `figures.gate_figure`'s, the demo's gates.png.
"""
from absl import flags

from allatt_jax.config import cli
from allatt_jax.reports import figures

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a pruning run.")
_OUT = flags.DEFINE_string("out", None, "Where to write the figure "
                           "(default: WORKDIR/gates.png).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv   # cli.run refuses extra arguments
  out_file = figures.gate_figure(_WORKDIR.value, _OUT.value)
  print(f"Wrote {out_file}")


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
