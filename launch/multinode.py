#!/usr/bin/env python3
r"""Train on several GPU machines with plain `jax.distributed`: over SSH, or as a Slurm job.

SSH: one process per host, each using all its GPUs; host 0 runs the coordinator.

  python launch/multinode.py --hosts=gpu-a,gpu-b --repo_dir=/shared/allatt_jax \
      -- --config=configs/wt103_base.py --workdir=/shared/runs/wt103_base

starts `python -m allatt_jax.main --coordinator_address=gpu-a:PORT --num_processes=2
--process_id=I ...` on each host over ssh and prints every host's output prefixed with
its index. JAX stops all processes when one dies. `--hosts=localhost,localhost` with
`--platform=cpu` runs two CPU processes on this machine, as a smoke test.

Slurm: one process per GPU (`srun`, tasks = nodes x GPUs per node); JAX reads the
job's layout from Slurm's environment, so no coordinator flags are passed.

  python launch/multinode.py --slurm --nodes=2 --gpus_per_node=8 \
      --repo_dir=/shared/allatt_jax -- --config=configs/wt103_base.py --workdir=...

submits the batch script with `sbatch`. Either way, `--workdir` must be on storage that
every host sees (NFS, Lustre, or gs://): all processes write one checkpoint there.
`--dry_run` prints the commands (for Slurm, the sbatch call with its script).

Only the standard library is used; the code and its environment must already be
installed on every host (`pip install -e REPO_DIR` in `--python`'s environment).
"""
import argparse
import shlex
import subprocess
import sys
import threading


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hosts", default="", help="SSH: comma-separated hosts, host 0 first.")
  parser.add_argument("--port", type=int, default=12355, help="SSH: coordinator port on host 0.")
  parser.add_argument("--coordinator_host", default=None,
                      help="SSH: host 0's address as the others reach it (default: its name).")
  parser.add_argument("--platform", default=None, help="Set JAX_PLATFORMS (e.g. cpu, cuda).")
  parser.add_argument("--slurm", action="store_true", help="Submit a Slurm batch job.")
  parser.add_argument("--nodes", type=int, default=1, help="Slurm: nodes.")
  parser.add_argument("--gpus_per_node", type=int, default=8, help="Slurm: GPUs per node.")
  parser.add_argument("--partition", default=None, help="Slurm: partition.")
  parser.add_argument("--time", default=None, help="Slurm: time limit, e.g. 48:00:00.")
  parser.add_argument("--job_name", default="allatt_jax", help="Slurm: job name.")
  parser.add_argument("--repo_dir", required=True,
                      help="Checkout of allatt_jax on every host (configs/ are read there).")
  parser.add_argument("--python", default="python3",
                      help="Python of the environment allatt_jax is installed in.")
  parser.add_argument("--dry_run", action="store_true", help="Print the commands only.")
  parser.add_argument("main_args", nargs="*", help="After --: allatt_jax.main flags.")
  args = parser.parse_args(argv)
  args.hosts = [h for h in args.hosts.split(",") if h]
  if "--dry_run" in args.main_args:
    parser.error("--dry_run after -- would go to allatt_jax.main; put it before --")
  if args.slurm == bool(args.hosts):
    parser.error("give either --hosts (SSH) or --slurm")
  if not any(a.startswith("--workdir=") for a in args.main_args):
    parser.error("give the run's --config and --workdir after --")
  return args


def _run_command(args, extra_flags=()) -> str:
  """The shell command each process runs, from the checkout."""
  env = f"JAX_PLATFORMS={shlex.quote(args.platform)} " if args.platform else ""
  flags = " ".join(shlex.quote(a) for a in (*args.main_args, *extra_flags))
  return (f"cd {shlex.quote(args.repo_dir)} && "
          f"{env}exec {shlex.quote(args.python)} -m allatt_jax.main {flags}")


def ssh_commands(args) -> list[list[str]]:
  coordinator = f"{args.coordinator_host or args.hosts[0]}:{args.port}"
  return [["ssh", "-o", "BatchMode=yes", host, _run_command(args, (
              f"--coordinator_address={coordinator}", f"--num_processes={len(args.hosts)}",
              f"--process_id={i}"))]
          for i, host in enumerate(args.hosts)]


def slurm_script(args) -> str:
  tasks = args.gpus_per_node
  lines = ["#!/bin/bash", f"#SBATCH --job-name={args.job_name}",
           f"#SBATCH --nodes={args.nodes}",
           # One task per GPU, each seeing all of its node's GPUs: JAX gives task
           # SLURM_LOCALID the GPU of that index.
           f"#SBATCH --ntasks-per-node={tasks}", f"#SBATCH --gpus-per-node={tasks}",
           f"#SBATCH --output={args.job_name}-%j.log"]
  lines += [f"#SBATCH --partition={args.partition}"] if args.partition else []
  lines += [f"#SBATCH --time={args.time}"] if args.time else []
  lines += ["set -euo pipefail", f"srun bash -c {shlex.quote(_run_command(args))}"]
  return "\n".join(lines) + "\n"


def _stream(index: int, process: subprocess.Popen) -> None:
  for line in process.stdout:
    sys.stdout.write(f"[{index}] {line}")
    sys.stdout.flush()


def run_ssh(commands) -> int:
  """Runs all processes; when one fails, stops the others and returns its status."""
  processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for c in commands]
  streams = [threading.Thread(target=_stream, args=(i, p), daemon=True)
             for i, p in enumerate(processes)]
  for thread in streams:
    thread.start()
  status = 0
  for i, process in enumerate(processes):
    if (code := process.wait()) and not status:
      status = code
      print(f"process {i} ({shlex.join(commands[i][:4])}) exited with status {code}",
            file=sys.stderr)
      for other in processes:
        other.terminate()
  for thread in streams:
    thread.join()
  return status


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.slurm:
    script = slurm_script(args)
    if args.dry_run:
      print(f"sbatch <<'EOF'\n{script}EOF")
      return 0
    return subprocess.run(["sbatch"], input=script, text=True).returncode
  commands = ssh_commands(args)
  if args.dry_run:
    print("\n".join(shlex.join(c) + " &" for c in commands) + "\nwait")
    return 0
  return run_ssh(commands)


if __name__ == "__main__":
  sys.exit(main())
