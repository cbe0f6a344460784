"""The launch scripts' dry runs print the exact, valid commands they would run."""
import importlib.util
import pathlib
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MAIN_ARGS = ["--", "--config=configs/wt103_base.py", "--config.train.num_steps=100"]


def load(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "launch" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


tpu_vm = load("tpu_vm")
multinode = load("multinode")


def dry_run(module, args, capsys) -> str:
  assert module.main(["--dry_run", *args]) == 0
  script = capsys.readouterr().out
  # What is printed is a shell script that bash accepts as is.
  subprocess.run(["bash", "-n"], input=script, text=True, check=True)
  return script


def commands(script: str) -> list[list[str]]:
  return [shlex.split(line) for line in script.splitlines()
          if line and not line.startswith("#")]


TPU_ARGS = ["--name=allatt-pod", "--zone=us-central2-b", "--accelerator_type=v4-32",
            "--project=my-project", "--workdir=gs://bucket/runs/wt103",
            "--data_from=gs://bucket/data/wikitext-103/"]


def test_tpu_vm_full_cycle(capsys):
  script = dry_run(tpu_vm, [*TPU_ARGS, *MAIN_ARGS], capsys)
  steps = [line[2:] for line in script.splitlines() if line.startswith("# ")]
  assert steps == ["create", "setup", "setup", "setup", "run", "logs", "delete"]
  create, archive, scp, setup, run, logs, delete = commands(script)
  location = ["--zone=us-central2-b", "--project=my-project"]
  assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", "allatt-pod",
                    "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", *location]
  assert archive[:3] == ["git", "-C", str(REPO)] and archive[-1] == "HEAD"
  assert scp[4:] == ["scp", "/tmp/allatt_jax-src.tar.gz", "allatt-pod:~/allatt_jax-src.tar.gz",
                     "--worker=all", *location]
  assert setup[4:7] == ["ssh", "allatt-pod", "--worker=all"]
  assert "pip install -e ~/allatt_jax 'jax[tpu]>=0.10,<0.12'" in setup[7]
  assert "gcloud storage cp -r gs://bucket/data/wikitext-103 ~/data/" in setup[7]
  assert run[4:7] == ["ssh", "allatt-pod", "--worker=all"]
  # Every worker runs the same command: JAX finds the other workers by itself.
  remote = run[7].removeprefix("--command=")
  assert "python3 -m allatt_jax.main --workdir=gs://bucket/runs/wt103 " \
         "--config=configs/wt103_base.py --config.train.num_steps=100 " \
         "--config.data.manual_dir=$HOME/data/wikitext-103" in remote
  assert "--coordinator_address" not in remote and "nohup" in remote
  assert logs[4:7] == ["ssh", "allatt-pod", "--worker=0"]
  assert delete[4:] == ["delete", "allatt-pod", "--quiet", *location]


def test_tpu_vm_clones_a_git_source_and_runs_chosen_steps(capsys):
  script = dry_run(tpu_vm, [*TPU_ARGS[:-1], "--steps=setup,run",
                            "--source=https://github.com/YOUR_ORG/allatt_jax.git@v0.1",
                            *MAIN_ARGS], capsys)
  setup, run = commands(script)
  assert ("git clone --depth 1 --branch v0.1 https://github.com/YOUR_ORG/allatt_jax.git "
          "~/allatt_jax") in setup[7]
  assert "manual_dir" not in run[7]


@pytest.mark.parametrize("args,message", [
    (["--workdir=/tmp/run"], "must be a gs:// path"),
    (["--workdir=gs://b/r", "--steps=create,train"], "unknown steps"),
])
def test_tpu_vm_refuses_bad_arguments(args, message, capsys):
  with pytest.raises(SystemExit):
    tpu_vm.main(["--dry_run", "--name=n", "--zone=z", *args, *MAIN_ARGS])
  assert message in capsys.readouterr().err


def test_multinode_ssh(capsys):
  script = dry_run(multinode, ["--hosts=gpu-a,gpu-b,gpu-c", "--repo_dir=/shared/allatt jax",
                               "--python=/opt/venv/bin/python", "--", "--config=c.py",
                               "--workdir=/shared/runs/x"], capsys)
  lines = commands(script)
  assert lines[-1] == ["wait"]
  for i, (host, command) in enumerate(zip(("gpu-a", "gpu-b", "gpu-c"), lines)):
    assert command[:4] == ["ssh", "-o", "BatchMode=yes", host] and command[-1] == "&"
    assert shlex.split(command[4]) == [
        "cd", "/shared/allatt jax", "&&", "exec", "/opt/venv/bin/python", "-m",
        "allatt_jax.main", "--config=c.py", "--workdir=/shared/runs/x",
        "--coordinator_address=gpu-a:12355", "--num_processes=3", f"--process_id={i}"]


def test_multinode_slurm(capsys):
  script = dry_run(multinode, ["--slurm", "--nodes=4", "--gpus_per_node=8", "--time=48:00:00",
                               "--repo_dir=/shared/allatt_jax", "--", "--config=c.py",
                               "--workdir=/shared/runs/x"], capsys)
  lines = script.splitlines()
  assert lines[0] == "sbatch <<'EOF'" and lines[-1] == "EOF"
  for directive in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8",
                    "--time=48:00:00"):
    assert f"#SBATCH {directive}" in lines
  assert lines[-2] == ("srun bash -c 'cd /shared/allatt_jax && exec python3 -m "
                       "allatt_jax.main --config=c.py --workdir=/shared/runs/x'")


def test_multinode_needs_one_mode(capsys):
  with pytest.raises(SystemExit):
    multinode.main(["--dry_run", "--repo_dir=r", "--", "--workdir=w"])
  assert "either --hosts (SSH) or --slurm" in capsys.readouterr().err


@pytest.mark.slow
def test_main_takes_the_flags_the_scripts_pass():
  # In a subprocess: other CLIs imported by this test session define flags of the
  # same names (--config), which absl refuses to define twice in one process.
  help_text = subprocess.run(
      [sys.executable, "-m", "allatt_jax.main", "--helpfull"], capture_output=True,
      text=True, check=False).stdout
  for name in ("coordinator_address", "num_processes", "process_id", "config", "workdir"):
    assert f"--{name}" in help_text


@pytest.mark.parametrize("module,args", [
    (tpu_vm, ["--name=n", "--zone=z", "--workdir=gs://b/r"]),
    (multinode, ["--hosts=a", "--repo_dir=r"]),
])
def test_dry_run_after_the_separator_is_refused(module, args, capsys):
  with pytest.raises(SystemExit):
    module.main([*args, *MAIN_ARGS, "--workdir=w", "--dry_run"])
  assert "put it before --" in capsys.readouterr().err
