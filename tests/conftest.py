"""Tests, and the `python -m allatt_jax...` processes they start, import this
checkout's allatt_jax, also where another checkout of it is installed (an editable
install of another worktree would otherwise win in the subprocesses).

The test process keeps the steps it compiles in a persistent compilation cache of its
own: many tests (and many files) train the same tiny runs, whose train, evaluation and
export steps are most of their CPU time. The cache is this process's only (one per
xdist worker, none shared between processes), and the commands the tests start do not
use it: they compile their own steps, as they would outside the tests."""
import os
import pathlib
import sys

import pytest

REPO = str(pathlib.Path(__file__).resolve().parents[1])
if REPO not in sys.path:
  sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO, os.environ.get("PYTHONPATH")) if p)

_CACHE_SETTINGS = {"jax_compilation_cache_dir": None,
                   "jax_persistent_cache_min_compile_time_secs": 0}


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """This process's persistent compilation cache, new for each session."""
  import jax  # pylint: disable=import-outside-toplevel
  settings = {**_CACHE_SETTINGS,
              "jax_compilation_cache_dir": str(tmp_path_factory.mktemp("jax_cache"))}
  before = {key: getattr(jax.config, key) for key in settings}
  for key, value in settings.items():
    jax.config.update(key, value)
  yield
  for key, value in before.items():
    jax.config.update(key, value)
