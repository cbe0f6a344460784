"""The commands of allatt_jax: `python -m allatt_jax` lists them,
`python -m allatt_jax COMMAND [flags]` runs one (as `python -m allatt_jax.COMMAND`).

The installed console scripts (setup.py) run through here too: `allatt-jax COMMAND`,
and `allatt-train`, `allatt-evaluate`, `allatt-score`, `allatt-sample`,
`allatt-export` for the everyday ones.
"""
import ast
import functools
import importlib.util
import pathlib
import runpy
import sys

# In the order a user meets them.
COMMANDS = ("main", "evaluate", "score", "sample", "export", "costs", "plots", "data",
            "benchmark", "compile_check", "experiments")


def _source(command: str) -> pathlib.Path:
  spec = importlib.util.find_spec(f"allatt_jax.{command}")
  if spec.submodule_search_locations:   # a package: its __main__ is the command
    return pathlib.Path(spec.submodule_search_locations[0]) / "__main__.py"
  return pathlib.Path(spec.origin)


def summary(command: str) -> str:
  """The first sentence of the command's docstring (its first line, or its first
  paragraph where that line does not end it), read without importing the command."""
  doc = ast.get_docstring(ast.parse(_source(command).read_text(encoding="utf-8"))) or ""
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
  """Runs `python -m allatt_jax.COMMAND` with `argv` (default: sys.argv[1:])."""
  argv = sys.argv[1:] if argv is None else argv
  module = f"allatt_jax.{command}"
  sys.argv = [module, *argv]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


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
