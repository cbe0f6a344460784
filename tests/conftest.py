"""Tests, and the `python -m allatt_jax...` processes they start, import this
checkout's allatt_jax, also where another checkout of it is installed (an editable
install of another worktree would otherwise win in the subprocesses); they share one
persistent compilation cache for the session."""
import atexit
import os
import pathlib
import shutil
import sys
import tempfile

REPO = str(pathlib.Path(__file__).resolve().parents[1])
if REPO not in sys.path:
  sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO, os.environ.get("PYTHONPATH")) if p)

# The tiny runs of many tests compile the same steps, in this process and in the
# commands the tests start: JAX's persistent cache, new for each session (set before
# JAX is imported; a cache named in the environment is used instead).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="allatt_jax_tests_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
