"""The commands of allatt_jax: `python -m allatt_jax` lists them,
`python -m allatt_jax COMMAND [flags]` runs one (as `python -m allatt_jax.COMMAND`).

The installed console scripts (setup.py) run through here too: `allatt-jax COMMAND`,
and `allatt-train`, `allatt-evaluate`, `allatt-score`, `allatt-sample`,
`allatt-export` for the everyday ones.
"""
import ast
import functools
import importlib
import pathlib
import sys

from allatt_jax.config import interrupts

# Name -> module, in the order a user meets them. A command module defines its flags
# and `run(argv)`; the first sentence of its docstring is its summary in `usage`.
COMMANDS = {
    "main": "allatt_jax.main",
    "evaluate": "allatt_jax.evaluate",
    "score": "allatt_jax.score",
    "sample": "allatt_jax.sample",
    "export": "allatt_jax.export",
    "costs": "allatt_jax.costs",
    "plots": "allatt_jax.plots",
    "data": "allatt_jax.data.__main__",
    "benchmark": "allatt_jax.benchmark",
    "compile_check": "allatt_jax.compile_check",
    "experiments": "allatt_jax.experiments.__main__",
    "readme_examples": "allatt_jax.readme_examples",
}


def summary(command: str) -> str:
  """The first sentence of the command's docstring (its first line, or its first
  paragraph where that line does not end it), read without importing the command."""
  source = pathlib.Path(__file__).parent.joinpath(
      *COMMANDS[command].split(".")[1:]).with_suffix(".py")
  doc = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8"))) or ""
  first_line = doc.strip().split("\n", 1)[0]
  if first_line.endswith("."):
    return first_line
  paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
  # A paragraph leading into an example ends with ':', which reads as cut off here.
  return paragraph[:-1] + "." if paragraph.endswith(":") else paragraph


def usage() -> str:
  width = max(map(len, COMMANDS))
  lines = [f"  {name:{width}}  {summary(name)}" for name in COMMANDS]
  return ("usage: python -m allatt_jax COMMAND [--flags]   (or python -m "
          "allatt_jax.COMMAND, or allatt-jax COMMAND)\n\ncommands:\n" + "\n".join(lines)
          + "\n\n`python -m allatt_jax.COMMAND --help` describes a command's flags.")


def run_command(command: str, argv=None) -> None:
  """Runs COMMAND on `argv` (its flags; default: sys.argv[1:]) as `python -m
  allatt_jax.COMMAND` runs it."""
  argv = sys.argv[1:] if argv is None else argv
  # A console script starts here: its imports end at once on Ctrl-C, as a `python -m`
  # command's do (allatt_jax/__init__.py).
  with interrupts.exiting_at_once():
    importlib.import_module(COMMANDS[command]).run([sys.argv[0], *argv])


def main() -> None:
  if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
    print(usage())
    return
  command = sys.argv[1]
  if command not in COMMANDS:
    print(f"error: unknown command {command!r}.\n\n{usage()}", file=sys.stderr)
    sys.exit(2)
  run_command(command, sys.argv[2:])


# Console scripts of the everyday commands (setup.py).
train = functools.partial(run_command, "main")
evaluate = functools.partial(run_command, "evaluate")
score = functools.partial(run_command, "score")
sample = functools.partial(run_command, "sample")
export = functools.partial(run_command, "export")


if __name__ == "__main__":
  main()
