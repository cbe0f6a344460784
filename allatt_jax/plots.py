"""Draws a pruning run's gates: each head's open probability at every logged step, and
the heads its export keeps.

  python -m allatt_jax.plots --workdir=RUN [--out=FILE.png]

RUN is a pruning run, or a pipeline's workdir (its newest pruning stage is drawn). The
figure is `figures.gate_figure`'s, the demo's gates.png.
"""
from absl import flags

from allatt_jax.config import cli
from allatt_jax.runs import run_files
from allatt_jax.reports import figures

_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir of a pruning run, or of a "
                               "pipeline (its newest pruning stage).")
_OUT = flags.DEFINE_string("out", None, "Where to write the figure "
                           "(default: gates.png in the pruning run drawn).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv   # cli.run refuses extra arguments
  drawn = figures.gated_run(_WORKDIR.value)
  out_file = figures.gate_figure(drawn, _OUT.value)
  stage = ("" if drawn == run_files.run_path(_WORKDIR.value)
           else f" (the gates of {drawn}, the pipeline's newest pruning stage)")
  print(f"Wrote {out_file}{stage}")


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
