"""The package's layout: commands on top, the library in folders, the measuring tools
apart (`perf/`), which no library module imports."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "allatt_jax"


def _module(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.ImportFrom) and node.module:
      found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    elif isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
  return found


def _commands() -> set[str]:
  from allatt_jax import __main__ as registry  # pylint: disable=import-outside-toplevel
  return set(registry.COMMANDS.values())


# What stands on top beside the commands: the package's face, the command list and the
# Python API.
NOT_COMMANDS = {"allatt_jax", "allatt_jax.__main__", "allatt_jax.api"}


def test_every_top_level_module_is_a_listed_command_with_its_own_code():
  top = {_module(p) for p in PACKAGE.glob("*.py")} - NOT_COMMANDS
  commands = _commands()
  assert top <= commands, f"top-level modules not in `python -m allatt_jax`: {top - commands}"
  for name in top:
    tree = ast.parse((PACKAGE / f"{name.rsplit('.', 1)[1]}.py").read_text(encoding="utf-8"))
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"main", "run"} <= defined, f"{name} is not a command of its own: {defined}"


def test_no_library_module_imports_a_command():
  commands = _commands()
  for path in PACKAGE.rglob("*.py"):
    name = _module(path)
    if name in commands or name in NOT_COMMANDS:
      continue
    assert not _imports(path) & commands, f"{name} imports {_imports(path) & commands}"


def test_no_library_module_imports_the_measuring_tools():
  commands = _commands()
  for path in PACKAGE.rglob("*.py"):
    name = _module(path)
    if name in commands or name.startswith("allatt_jax.perf"):
      continue
    perf = {m for m in _imports(path) if m.startswith("allatt_jax.perf")}
    assert not perf, f"{name} imports the measuring tools: {perf}"
