"""Tests, and the `python -m allatt_jax...` processes they start, import this
checkout's allatt_jax, also where another checkout of it is installed (an editable
install of another worktree would otherwise win in the subprocesses).

The tests keep the steps they compile in a persistent compilation cache, new for each
session and shared by everything the session runs: the test processes (each xdist
worker) and the commands the tests start (`python -m allatt_jax.main` ...), which read
it from JAX_COMPILATION_CACHE_DIR. Many tests (and many files) train the same tiny
runs, and a restarted or resumed run compiles the steps its first start compiled:
compiling is most of these runs' CPU time. A cached step is the executable XLA
compiled for the same program, options and devices, so a run computes what it would
compute after compiling the step itself."""
import os
import pathlib
import subprocess
import sys

import pytest

REPO = str(pathlib.Path(__file__).resolve().parents[1])
if REPO not in sys.path:
  sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO, os.environ.get("PYTHONPATH")) if p)

# The tests compile far more than they compute (tiny models, a few steps each), so they
# ask XLA's CPU backend for machine code that is quicker to make. Measured on 2 cores: LLVM
# optimization level 0 compiles a tiny pipeline's steps in 20 s instead of 49 s, and the
# older elemental emitters for fusions (instead of the MLIR ones) then compile a tiny
# pruning run's steps in 7.3 s instead of 12.9 s; the whole suite took 19% less time with
# them. The programs are the same; only their machine code is less optimised. Set
# before JAX starts its backend, and inherited by the commands the tests start.
_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)
# XLA aborts on a flag it does not know, so one that a jaxlib in setup.py's range may
# have dropped is first tried in a process of its own (once: the xdist workers and the
# commands inherit the result).
_TEST_XLA_FLAGS_IF_KNOWN = ("--xla_cpu_use_fusion_emitters=false",)


def _known(flag: str) -> bool:
  env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1)"],
                        env=env, capture_output=True, check=False).returncode == 0


# A flag already in XLA_FLAGS (the user's, or a parent process's) is kept as it is.
_flags = os.environ.get("XLA_FLAGS", "").split()
_set = {flag.split("=")[0] for flag in _flags}
_flags += [flag for flag in _TEST_XLA_FLAGS if flag.split("=")[0] not in _set]
_flags += [flag for flag in _TEST_XLA_FLAGS_IF_KNOWN
           if flag.split("=")[0] not in _set and _known(flag)]
os.environ["XLA_FLAGS"] = " ".join(_flags)

_CACHE_SETTINGS = {"jax_compilation_cache_dir": None,
                   "jax_persistent_cache_min_compile_time_secs": 0,
                   "jax_persistent_cache_min_entry_size_bytes": 0}


def _session_dir(tmp_path_factory) -> pathlib.Path:
  """A folder of this session's own: with xdist, the one its workers' folders are in."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """This session's persistent compilation cache, for this process and the commands
  the tests start (through the environment, which they inherit)."""
  import jax  # pylint: disable=import-outside-toplevel
  cache_dir = _session_dir(tmp_path_factory) / "jax_cache"
  cache_dir.mkdir(exist_ok=True)
  settings = {**_CACHE_SETTINGS, "jax_compilation_cache_dir": str(cache_dir)}
  before = {key: getattr(jax.config, key) for key in settings}
  environ_before = {key.upper(): os.environ.get(key.upper()) for key in settings}
  for key, value in settings.items():
    jax.config.update(key, value)
    os.environ[key.upper()] = str(value)
  yield
  for key, value in before.items():
    jax.config.update(key, value)
  for key, value in environ_before.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value


# Test files, longest first (their time on 2 cores), for the full suite and for the fast
# tier, whose files take other times (a file's slow tests are most of some files' time).
# xdist's loadfile scheduling hands out whole files in collection order (pytest.ini
# turns off its own reordering by number of tests): long files start first and short
# ones fill in at the end, rather than a long file that starts last running on alone.
# Unlisted files run after these; the order changes nothing but the wall time.
_LONGEST_FIRST = (
    "test_experiments", "test_training_reliability", "test_training_loop",
    "test_training_preemption", "test_api", "test_pruning_budget",
    "test_training_distill", "test_parallel_multidevice", "test_commands",
    "test_perf_benchmark", "test_model_split_core", "test_parallel_multihost",
    "test_model_adaptive", "test_perf_compile_check", "test_model_transformer",
    "test_experiments_repro", "test_training_train_step",
    "test_evaluation_score_sample", "test_data_text_files", "test_launch_colab",
    "test_runs_checkpoint_fallback", "test_model_attention",
    "test_pruning_persistent_groups", "test_pruning_cost_model", "test_perf_hlo_counts",
    "test_model_reference")
_LONGEST_FIRST_FAST = (
    "test_commands", "test_model_split_core", "test_training_distill",
    "test_model_adaptive", "test_model_transformer", "test_training_checks_first",
    "test_pruning_persistent_groups", "test_model_attention", "test_experiments",
    "test_perf_hlo_counts", "test_data", "test_training_train_step", "test_api",
    "test_evaluation", "test_runs_workdir_checks", "test_reports_figures",
    "test_pruning_cost_model", "test_training_reliability", "test_pruning_export",
    "test_pruning_budget", "test_runs_checkpointing", "test_perf_benchmark",
    "test_training_optim")


@pytest.hookimpl(trylast=True)   # after `-m` has deselected what it leaves out
def pytest_collection_modifyitems(items):
  fast_tier = not any(item.get_closest_marker("slow") for item in items)
  order = _LONGEST_FIRST_FAST if fast_tier else _LONGEST_FIRST
  rank = {name: i for i, name in enumerate(order)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable within a file
