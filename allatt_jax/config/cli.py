"""What every `python -m allatt_jax.<command>` shares: config flags and one error path.

A command defines its flags (`DEFINE_config` for a run config) and ends with
`cli.run(main)`. Every expected failure (a bad flag, a config file missing or failing
to load, an unknown override key, an AllattError) prints one `error: ...` line and
exits with status 2; only a bug prints a traceback. Config files are found by path or
by name among the installed configs (`--config=wt103_prune.py:lam=0.015`).
"""
import difflib
import functools
import os
import pathlib
import re
import sys
import traceback
from typing import NoReturn

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_dict
from ml_collections import config_flags

from allatt_jax.config import config_base
from allatt_jax.config import console
from allatt_jax.config import errors
from allatt_jax.config import interrupts

# Flags defined through this module belong to the command that calls it (its --help).
flags.disclaim_key_flags()

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]
# Installed, setup.py puts configs/ into the package; in a checkout it is its sibling.
CONFIG_DIR = (_PACKAGE_DIR / "configs" if (_PACKAGE_DIR / "configs").is_dir()
              else _PACKAGE_DIR.parent / "configs")

BUG_REPORT = ("This is a bug (or a failure of the machine: disk, memory, network), not "
              "a problem with your input: please report it with the command line and "
              "the traceback above.")


def config_names() -> list[str]:
  """The file names of the shipped configs."""
  return sorted(p.name for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_"))


def find_config(path: str) -> pathlib.Path:
  """The config file `path` names: a file, else a shipped config of that file name.

  Raises:
    ConfigError: neither exists.
  """
  given = pathlib.Path(path)
  if given.is_file():
    return given
  name = given.name if given.suffix == ".py" else f"{given.name}.py"
  shipped = CONFIG_DIR / name
  if path and shipped.is_file():
    return shipped
  raise errors.ConfigError(
      f"--config={path}: no such file, nor a shipped config of that name. Give the "
      f"path of a config file, or one of: {', '.join(config_names())}.")


def load_config(spec: str) -> config_dict.ConfigDict:
  """`get_config(arg)` of the config file of `spec` ('path.py' or 'path.py:arg').

  Raises:
    ConfigError: the file is missing, or importing it or calling get_config fails.
  """
  path, has_arg, arg = spec.partition(":")
  file = find_config(path)
  try:
    config = config_base.load(file, arg if has_arg else None)
  except Exception as e:  # pylint: disable=broad-except  (any error of the user's file)
    last_line = traceback.format_exception_only(e)[-1].strip().rstrip(".")
    raise errors.ConfigError(
        f"--config={spec}: {file} failed to load: {last_line}. Fix the file, or the "
        "argument after ':' (its docstring lists them).") from None
  if not isinstance(config, config_dict.ConfigDict):
    raise errors.ConfigError(f"--config={spec}: get_config() of {file} returned "
                             f"{type(config).__name__}, not a ConfigDict.")
  return config


def _key_paths(config: config_dict.ConfigDict, prefix: str = "") -> list[str]:
  paths = []
  for key, value in config.items():
    paths.append(prefix + key)
    if isinstance(value, config_dict.ConfigDict):
      paths += _key_paths(value, f"{prefix}{key}.")
  return paths


def check_override_keys(name: str, config: config_dict.ConfigDict, argv) -> None:
  """Raises ConfigError naming the first `--NAME.a.b=` of `argv` that is no key of
  `config`, with the closest existing keys."""
  for arg in argv:
    match = re.match(rf"-{{1,2}}(?:no)?{re.escape(name)}\.([^=\s]+)", arg)
    if not match:
      continue
    node, path = config, []
    for key in (part.split("[")[0] for part in match.group(1).split(".")):
      if isinstance(node, config_dict.ConfigDict) and key in node:
        node, path = node[key], path + [key]
        continue
      where = ".".join([name, *path])
      if not isinstance(node, config_dict.ConfigDict):
        raise errors.ConfigError(f"--{name}.{match.group(1)}: {where} is a value, not a "
                                 f"section; set it with --{where}=VALUE.")
      known = _key_paths(config)
      close = difflib.get_close_matches(".".join(path + [key]), known, n=3, cutoff=0.6)
      close += [k for k in known if k.rsplit(".", 1)[-1] == key and k not in close]
      hint = ("did you mean " + ", ".join(f"--{name}.{k}" for k in close) + "?" if close
              else f"{where} holds {', '.join(node)}.")
      raise errors.ConfigError(f"--{name}.{match.group(1)}: {where} has no key {key!r}; "
                               f"{hint}")


class _ConfigFileParser(flags.ArgumentParser):
  """Parses `--NAME=path.py[:arg]` as config_flags does, with shipped-config lookup
  and one-line errors."""

  def __init__(self, name: str, lock_config: bool):
    self.name, self.lock_config = name, lock_config

  def parse(self, argument):
    config = load_config(argument)
    check_override_keys(self.name, config,
                        flags.FLAGS.read_flags_from_files(sys.argv, force_gnu=False))
    if self.lock_config:
      config.lock()
    return config

  def flag_type(self):
    return "config file"


def DEFINE_config(name: str, help_string: str, *, lock_config: bool = True,  # pylint: disable=invalid-name
                  required: bool = True) -> flags.FlagHolder:
  """A config-file flag (`--NAME=path.py[:arg]`, overrides `--NAME.key=value`)."""
  holder = config_flags.DEFINE_config_file(
      name, None, f"{help_string} A path, or the name of a shipped config "
      f"({', '.join(config_names())}), optionally followed by ':ARG'; override any "
      f"key with --{name}.SECTION.KEY=VALUE.", lock_config=lock_config)
  flags.FLAGS[name].parser = _ConfigFileParser(name, lock_config=lock_config)
  if required:
    flags.mark_flag_as_required(name)
  return holder


def config_file_name(name: str) -> str:
  """The config file (with its `:arg`) that config flag `name` was given."""
  return config_flags.get_config_filename(flags.FLAGS[name])


def DEFINE_trained_model() -> tuple[flags.FlagHolder, flags.FlagHolder]:  # pylint: disable=invalid-name
  """--checkpoint (required) and --step of the commands that use a trained model."""
  checkpoint = flags.DEFINE_string(
      "checkpoint", None, "The model: a run's --workdir (its latest checkpoint unless "
      "--step; gated models use their deterministic gates) or an exported model folder.",
      required=True)
  step = flags.DEFINE_integer("step", None, "Checkpoint step of a run's workdir "
                              "(default: the latest finished one).", lower_bound=0)
  return checkpoint, step


def DEFINE_data_folders(manual_dir_help: str, data_dir_help: str  # pylint: disable=invalid-name
                        ) -> tuple[flags.FlagHolder, flags.FlagHolder]:
  """--manual_dir and --data_dir: where a dataset's files and its prepared ids lie
  (the data section's keys of the same names), with each command's own help."""
  return (flags.DEFINE_string("manual_dir", None, manual_dir_help),
          flags.DEFINE_string("data_dir", None, data_dir_help))


# absl's flags that print help (then exiting with status 1, here with 0: help that was
# asked for is a success, and scripts and `&&` chains go on).
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")


def _print_help(command, asked) -> None:
  """absl's help (`app.usage`) of `command`, whether it runs as `python -m
  allatt_jax.COMMAND` (as __main__) or as `python -m allatt_jax COMMAND`."""
  if "helpxml" in asked:
    flags.FLAGS.write_help_in_xml_format(sys.stdout)
    return
  # absl files a flag under the name of the module defining it, sys.argv[0] for __main__.
  flag_module = sys.argv[0] if command.__name__ == "__main__" else command.__name__
  if "helpfull" in asked:
    print(f"{command.__doc__}\nflags:\n{flags.FLAGS.get_help()}")
  else:
    print(f"{command.__doc__}\nflags:\n{flags.FLAGS.module_help(flag_module)}\n\n"
          "Try --helpfull to get a list of all flags.")


def _parse_flags(command, argv):
  asked = {arg.lstrip("-").split("=")[0] for arg in argv[1:] if arg.startswith("-")}
  if asked & set(_HELP_FLAGS):
    _print_help(command, asked)
    sys.exit(0)
  with errors.reported_to_user():
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
      # absl's words for a missing required flag: "flag --x=None: Flag --x must have a
      # value other than None."
      message = re.sub(r"flag (--\w+)=None: Flag --\w+ must have a value other than "
                       r"None\.", r"\1 is required.", message)
      raise errors.FlagError(f"{message} (--help lists the flags).") from None


def advice_for_command(message: str, flag_names: dict[str, str],
                       fallback: str = "") -> str:
  """`message` as a command without a config flag says it.

  Errors below the commands name run config keys as `--config.SECTION.KEY` flags. Each
  such flag becomes the command's own (`flag_names`: 'SECTION.KEY' -> '--flag'); a
  sentence naming a key the command cannot set is dropped, and `fallback` (the fix
  this command offers instead) added when no advice with a flag is left.
  """
  sentences = re.split(r"(?<=\.) (?=[A-Z(])", message)
  kept, advice_left = [], False
  for sentence in sentences:
    keys = re.findall(r"--config\.([\w.]+)", sentence)
    if all(key in flag_names for key in keys):
      kept.append(re.sub(r"--config\.([\w.]+)", lambda m: flag_names[m.group(1)],
                         sentence))
      advice_left = advice_left or bool(keys)
  if len(kept) < len(sentences) and not advice_left and fallback:
    kept.append(fallback)
  return " ".join(kept)


def _exit_failed(status: int) -> NoReturn:
  """Ends the command, which failed in this process, with `status`.

  In a run of several processes, the others may be waiting for this one in a
  collective or at a barrier it will never reach, and a normal exit would wait for
  them in turn (JAX's shutdown barrier, orbax's threads of a save in flight): the job
  would hang for minutes instead of failing. Exiting at once closes this process's
  connections, so a collective waiting on it fails within seconds, and the
  coordination service reports it missing to the others within its heartbeat
  timeout. A save in flight never counts: orbax commits a checkpoint by renaming its
  finished folder.
  """
  if jax.distributed.is_initialized() and jax.process_count() > 1:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access
  sys.exit(status)


def _reported_main(main, argv, flag_names, fallback_advice):
  if flags.FLAGS.verbosity < 1:
    logging.get_absl_handler().addFilter(console.LibraryChatterFilter())
    logging.get_absl_handler().setFormatter(console.PlainFormatter())
  # The command's work starts: Ctrl-C now raises KeyboardInterrupt (interrupts.py),
  # one line below, until a run's PreemptionWatch takes it over.
  with errors.reported_to_user(_exit_failed), interrupts.keyboard_interrupts():
    if len(argv) > 1:
      raise errors.FlagError(f"unexpected arguments {argv[1:]}: flags take the form "
                             "--name=value (--help lists them).")
    try:
      return main(argv)
    except app.UsageError as e:
      raise errors.FlagError(str(e)) from None
    except errors.AllattError as e:
      if flag_names is None:
        raise
      raise type(e)(advice_for_command(str(e), flag_names, fallback_advice)) from None
    except errors.Preempted:
      raise
    except BrokenPipeError:
      # The reader of the output went away (`| head`): nothing is wrong, nothing to say.
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      _exit_failed(1)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      print(f"error: {BUG_REPORT}", file=sys.stderr)
      _exit_failed(1)


def run(main, argv=None, flag_names: dict[str, str] | None = None,
        fallback_advice: str = "") -> None:
  """absl's `app.run(main, argv)` with the error path of every command (module
  docstring). `argv`: the command line, program name first (default: sys.argv);
  `--help` describes the flags of the module defining `main`.

  A command without a config flag gives `flag_names` (its flags for the config keys
  it can set, maybe none) and `fallback_advice`: see `advice_for_command`.
  """
  app.run(functools.partial(_reported_main, main, flag_names=flag_names,
                            fallback_advice=fallback_advice), argv=argv,
          flags_parser=functools.partial(_parse_flags, sys.modules[main.__module__]))
