#!/usr/bin/env python3
r"""Train on a Cloud TPU VM or pod slice: create it, install, run, stream logs, delete.

  python launch/tpu_vm.py --name=allatt-v4-32 --zone=us-central2-b \
      --accelerator_type=v4-32 --workdir=gs://BUCKET/runs/wt103_base \
      --data_from=gs://BUCKET/data/wikitext-103 -- --config=configs/wt103_base.py

Arguments after `--` go to `python -m allatt_jax.main` on every worker (the run's
--config and overrides). Each worker joins the run by itself: JAX reads the slice's
layout from the TPU metadata (allatt_jax/parallel/distributed.py), so no coordinator flags.

Steps (--steps, in this order): create the TPU; setup (copy this checkout, or clone
--source, to ~/allatt_jax on every worker and pip-install it with jax[tpu]; copy
--data_from to ~/data); run (start training detached on every worker, output in
~/allatt_jax.log); logs (follow worker 0's log until training ends; fails if it
failed); delete the TPU. A failed step stops the script, so a failed run leaves the
TPU up for inspection. `--dry_run` prints the commands instead, as a shell script.

Only the standard library is used: run it from any machine with gcloud.
"""
import argparse
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = ("create", "setup", "run", "logs", "delete")
REMOTE_DIR = "~/allatt_jax"
LOG = "~/allatt_jax.log"
STATUS = "~/allatt_jax.status"
ARCHIVE = "allatt_jax-src.tar.gz"
JAX_TPU = "jax[tpu]>=0.10,<0.12"


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--name", required=True, help="TPU name.")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--accelerator_type", default="v4-8", help="e.g. v4-8, v4-32, v5p-64.")
  parser.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU software version.")
  parser.add_argument("--project", default=None, help="Default: gcloud's configured project.")
  parser.add_argument("--spot", action="store_true", help="Create a Spot TPU.")
  parser.add_argument(
      "--source", default="local",
      help="'local' (this checkout's HEAD, via git archive) or GIT_URL[@REF] to clone, "
           "e.g. https://github.com/YOUR_ORG/allatt_jax.git@main.")
  parser.add_argument("--workdir", required=True,
                      help="gs:// folder for checkpoints and logs, shared by all workers.")
  parser.add_argument("--data_from", default=None,
                      help="gs:// folder of the dataset's official files, copied to ~/data "
                      "on every worker and passed as --config.data.manual_dir.")
  parser.add_argument("--steps", default=",".join(STEPS),
                      help=f"Comma-separated subset of {','.join(STEPS)}.")
  parser.add_argument("--dry_run", action="store_true", help="Print the commands only.")
  parser.add_argument("main_args", nargs="*", help="After --: allatt_jax.main flags.")
  args = parser.parse_args(argv)
  args.steps = [s for s in args.steps.split(",") if s]
  if "--dry_run" in args.main_args:
    parser.error("--dry_run after -- would go to allatt_jax.main; put it before --")
  if unknown := set(args.steps) - set(STEPS):
    parser.error(f"unknown steps {sorted(unknown)}; choose from {STEPS}")
  if not args.workdir.startswith("gs://"):
    parser.error("--workdir must be a gs:// path: all workers write one checkpoint "
                 "there, and it must outlive the TPU.")
  if not any(a.startswith("--config=") for a in args.main_args):
    parser.error("give the run's config after --, e.g. -- --config=configs/wt103_base.py")
  return args


def _gcloud(args, *words):
  location = [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])
  return ["gcloud", "compute", "tpus", "tpu-vm", *words, *location]


def _on_workers(args, command: str, worker: str = "all"):
  return _gcloud(args, "ssh", args.name, f"--worker={worker}", f"--command={command}")


def _source_commands(args):
  """Local commands preparing the code, and the remote command unpacking it."""
  if args.source == "local":
    archive = f"/tmp/{ARCHIVE}"
    local = [["git", "-C", str(REPO), "archive", "--format=tar.gz", "--prefix=allatt_jax/",
              "-o", archive, "HEAD"],
             _gcloud(args, "scp", archive, f"{args.name}:~/{ARCHIVE}", "--worker=all")]
    return local, f"rm -rf {REMOTE_DIR} && tar -xzf ~/{ARCHIVE} -C ~"
  url, _, ref = args.source.partition("@")
  branch = f"--branch {shlex.quote(ref)} " if ref else ""
  return [], f"rm -rf {REMOTE_DIR} && git clone --depth 1 {branch}{shlex.quote(url)} {REMOTE_DIR}"


def _data_dir(args) -> str | None:
  if not args.data_from:
    return None
  return "$HOME/data/" + args.data_from.rstrip("/").rsplit("/", 1)[-1]


def commands(args) -> list[tuple[str, list[str]]]:
  """(step, argv) of every command, in order."""
  out = []
  if "create" in args.steps:
    create = _gcloud(args, "create", args.name, f"--accelerator-type={args.accelerator_type}",
                     f"--version={args.version}")
    out.append(("create", create + (["--spot"] if args.spot else [])))
  if "setup" in args.steps:
    local, unpack = _source_commands(args)
    out += [("setup", c) for c in local]
    install = (f"{unpack} && python3 -m pip install --upgrade pip && "
               f"python3 -m pip install -e {REMOTE_DIR} {shlex.quote(JAX_TPU)}")
    if args.data_from:
      install += (f" && mkdir -p ~/data && gcloud storage cp -r "
                  f"{shlex.quote(args.data_from.rstrip('/'))} ~/data/")
    out.append(("setup", _on_workers(args, install)))
  if "run" in args.steps:
    main_args = [f"--workdir={args.workdir}", *args.main_args]
    flags = " ".join(shlex.quote(a) for a in main_args)
    if data_dir := _data_dir(args):
      flags += f" --config.data.manual_dir={data_dir}"
    # Detached, so the run outlives the ssh session; its exit status is kept for `logs`.
    train = (f"cd {REMOTE_DIR} && rm -f {STATUS} && nohup bash -c "
             + shlex.quote(f"python3 -m allatt_jax.main {flags}; echo $? > {STATUS}")
             + f" > {LOG} 2>&1 < /dev/null &")
    out.append(("run", _on_workers(args, train)))
  if "logs" in args.steps:
    follow = (f"tail -n +1 -f {LOG} & tail_pid=$!; "
              f"while [ ! -s {STATUS} ]; do sleep 10; done; "
              f"sleep 2; kill $tail_pid; exit $(cat {STATUS})")
    out.append(("logs", _on_workers(args, follow, worker="0")))
  if "delete" in args.steps:
    out.append(("delete", _gcloud(args, "delete", args.name, "--quiet")))
  return out


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  for step, command in commands(args):
    if args.dry_run:
      print(f"# {step}\n{shlex.join(command)}")
      continue
    print(f"[{step}] {shlex.join(command)}", flush=True)
    if (code := subprocess.run(command).returncode) != 0:
      hint = ("; the TPU is still up: delete it with --steps=delete"
              if step not in ("create", "delete") else "")
      print(f"[{step}] failed with exit status {code}{hint}", file=sys.stderr)
      return code
  return 0


if __name__ == "__main__":
  sys.exit(main())
