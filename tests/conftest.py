"""Tests, and the `python -m allatt_jax...` processes they start, import this
checkout's allatt_jax, also where another checkout of it is installed (an editable
install of another worktree would otherwise win in the subprocesses)."""
import os
import pathlib
import sys

REPO = str(pathlib.Path(__file__).resolve().parents[1])
if REPO not in sys.path:
  sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
