"""'auto''s trial of a persistent part runs in a process of its own, ended at its limit
(allatt_jax/model/attention/persistent_trial.py)."""
import os
import pathlib
import time

import pytest

from allatt_jax.model.attention import persistent_trial


def _trial_processes() -> list[int]:
  """Process ids of this process's children that run a trial."""
  found = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
      command = (stat.parent / "cmdline").read_bytes()
    except (OSError, IndexError, ValueError):   # ended while read
      continue
    if parent == os.getpid() and b"persistent_trial" in command:
      found.append(int(stat.parent.name))
  return found


def test_a_trial_times_its_part_in_a_process_of_its_own():
  seconds = persistent_trial.seconds("xla", 0.2, True, "float32", limit=120)
  assert 0 < seconds < 10
  assert _trial_processes() == []


def test_a_trial_over_its_limit_is_ended_not_left_running():
  start = time.perf_counter()
  with pytest.raises(TimeoutError, match=r"not done within 0.3 s; its process was ended"):
    persistent_trial.seconds("xla", 0.2, True, "float32", limit=0.3)
  assert time.perf_counter() - start < 10
  assert _trial_processes() == []


def test_a_failed_trial_says_why_in_its_last_line():
  with pytest.raises(RuntimeError, match=r"^KeyError: 'no_such_part'$"):
    persistent_trial.seconds("no_such_part", 0.0, False, "float32", limit=120)
