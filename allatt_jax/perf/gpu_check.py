r"""The first thing a lent GPU runs (launch/gpu_check.sh): what the split core and its
persistent parts do there, each piece in a process of its own under a time limit, so
that a stalled compile costs that piece's seconds and the rest go on.

  python -m allatt_jax.perf.gpu_check              # on a GPU, within --budget (525 s)
  python -m allatt_jax.perf.gpu_check --dry-run    # on a CPU: the XLA parts at tiny shapes

Pieces (gpu_pieces.py), each rate's layers first, a part's trial right before its
layers, each printing its result as a JSON line. A part that fails its trial at a
rate, or stalls, is not timed at that rate; cuDNN's is not with dropout
(persistent_cores.refusal). Then, in a process of its own:

  benchmark         python -m allatt_jax.benchmark --config=configs/bench_gpu.py:lease
                    --profile: the config (at dropout 0.2 the XLA core) and `before`,
                    and the fastest split at 0.2 where its layer beat the XLA core's,
                    in the same rounds, with at least BENCHMARK_S seconds; its JSON and
                    log beside the report's

Writes the report as JSON (--json; default docs/bench/gpu_check_DATE.json) and its
table between the gpu_check markers of docs/performance.md (--doc); a dry run writes
both under --out_dir (default: a new temporary directory).
"""
import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from allatt_jax.model.attention import persistent_cores
from allatt_jax.perf import gpu_pieces

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Seconds each kind of piece may take; the benchmark gets what is left of the budget,
# at least BENCHMARK_S (its compiles of the WikiText-103 model take most of it).
LIMITS = dict(versions=45, part=60, layer=60, alone=45, tiles=60)
BENCHMARK_S = 300
BEGIN, END = "<!-- gpu_check: begin -->", "<!-- gpu_check: end -->"


def _spawn(command, limit: float, env=None, log: pathlib.Path | None = None) -> dict:
  """A command under `timeout`: its last JSON line of output, or how it failed (its
  whole output also in `log`, if given); one stopped at its limit keeps its last JSON
  line under its status 'timeout'."""
  start = time.perf_counter()
  done = subprocess.run(["timeout", "-k", "5", f"{max(limit, 1):.0f}", *command], cwd=ROOT,
                        capture_output=True, text=True, env=env, check=False)
  seconds = time.perf_counter() - start
  if log:
    log.write_text(done.stdout + done.stderr)
  lines = done.stdout.strip().splitlines()
  result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
  if done.returncode in (124, 137):
    return {**result, "status": "timeout", "seconds": seconds, "limit_s": limit}
  if done.returncode:
    tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
    return {"status": "failed", "seconds": seconds, "error": " | ".join(tail)}
  return {"status": "ok", **result, "seconds": seconds}


def _part_of(piece: str) -> str | None:
  """The persistent part a piece runs (None: the XLA core alone, or no part)."""
  kind, *args = piece.split(":")
  if kind == "versions" or (kind == "layer" and args[0] == "xla"):
    return None
  return args[0].removeprefix("split-")


def _pieces(dry: bool) -> list[str]:
  """The pieces in the order they run: the training rate's layer timings first (what
  the split core is for), then each part's trial right before the layers that run it."""
  parts = ("xla",) if dry else gpu_pieces.PARTS
  pieces = ["versions"]
  for rate in (0.2, 0.0):
    pieces += [f"layer:xla:{rate}"]
    for part in parts:
      pieces += [f"part:{part}:{rate}", f"layer:split-{part}:{rate}"]
  return pieces + [f"alone:{p}" for p in parts] + ([] if dry else ["tiles:pallas:0.2"])


def _skip_reason(piece: str, results: dict) -> str | None:
  """Why a piece is not run: its part refuses this rate, or failed its trial at it."""
  kind, *args = piece.split(":")
  part = _part_of(piece)
  if part is None:
    return None
  rate = 0.0 if kind == "alone" else float(args[-1])
  refused = persistent_cores.refusal(part, rate, False)
  if refused or kind == "part":
    return refused
  trial = results.get(f"part:{part}:{rate}", {})
  if trial.get("status") == "ok" and trial.get("agrees"):
    return None
  return f"the part's trial at attention dropout {rate} did not pass ({trial.get('status')})"


def _best_split(results: dict, dry: bool) -> str:
  """The persistent part of the fastest split core at dropout 0.2 (training's)."""
  parts = ("xla",) if dry else gpu_pieces.PARTS
  timed = {p: results.get(f"layer:split-{p}:0.2", {}) for p in parts}
  ok = {p: r["ms"] for p, r in timed.items() if r.get("status") == "ok" and "ms" in r}
  return min(ok, key=ok.get) if ok else "xla"


def _benchmark_flags(results: dict, dry: bool) -> list[str]:
  """The benchmark's config: on a GPU `configs/bench_gpu.py:lease` (the config and
  `before`), with the split core's fastest part at dropout 0.2 as a variant where its
  layer beat the XLA core's there (a train step that runs the split core is worth
  its minutes only then); a dry run always times the split core."""
  best = _best_split(results, dry)
  split = [f"--variant=split:model.attention_impl=split,model.persistent_impl={best}"]
  if dry:
    return ["--config=configs/bench_cpu.py:tiny", "--config.benchmark.gated_steps=False",
            *split]
  ms = lambda piece: results.get(piece, {}).get("ms", float("inf"))
  pays = ms(f"layer:split-{best}:0.2") < ms("layer:xla:0.2")
  return ["--config=configs/bench_gpu.py:lease", *(split if pays else [])]


def _benchmark(flags: list[str], out: pathlib.Path, log: pathlib.Path,
               limit: float) -> dict:
  """The benchmark with `flags` (`_benchmark_flags`) and --profile: the config's
  train step and its variants' in the same rounds. One stopped at its limit still
  gives the rounds it finished (the benchmark rewrites its report after each)."""
  out.unlink(missing_ok=True)
  result = _spawn([sys.executable, "-m", "allatt_jax.benchmark", *flags, "--profile",
                   f"--out={out}"], limit, log=log)
  if not out.exists():
    return result
  report = json.loads(out.read_text())
  train = report["train"]["baseline"]
  summary = {"xla": {"tokens_per_s": train["tokens_per_s"], "ratio": 1.0}}
  for name, variant in report.get("variants", {}).items():
    summary[name] = {"tokens_per_s": variant["train"]["tokens_per_s"],
                     "ratio": variant["train_tokens_per_s_ratio"]}
  return {**result, "flags": flags, "rounds_done": report["rounds_done"], "train": summary,
          "report": str(out)}


def table(report: dict) -> str:
  """The report as Markdown, for docs/performance.md."""
  v = report["pieces"].get("versions", {})
  lines = [f"{report['date']}, {v.get('device', '?')}, jax {v.get('jax', '?')}, CUDA "
           f"{v.get('cuda_runtime', '-')}, cuDNN {v.get('cudnn', '-')}"
           f"{' (dry run: CPU, tiny shapes)' if report['dry_run'] else ''}; "
           f"{report['seconds']:.0f} s in all.", "",
           "| piece | status | compile s | ms | note |", "|---|---|---|---|---|"]
  for name, r in report["pieces"].items():
    if name == "versions":
      continue
    note = r.get("why") or r.get("error") or ""
    if "max_difference" in r:
      note = (f"agrees with XLA: {r['agrees']} (largest difference "
              f"{max(r['max_difference'].values()):.1e})")
    elif "tiles" in r and r.get("best"):
      note = (f"fastest of {len(r['tiles'])} tiles: {r['best']}, "
              f"{r['tiles'][r['best']]['tflop_per_s']:.1f} TFLOP/s"
              + (f", {r['speedup']:.2f}x the default" if r.get("speedup") else ""))
    elif "tflop_per_s" in r:
      note = f"{r['tflop_per_s']:.1f} TFLOP/s"
    elif r.get("temp_bytes") is not None:
      note = f"XLA temporaries {r['temp_bytes'] / 2**20:,.0f} MiB"
    elif name == "benchmark" and "train" in r:
      note = f"{r['rounds_done']} rounds: " + ", ".join(
          f"{k}: {x['tokens_per_s']:,.0f} tokens/s (x{x['ratio']:.2f})"
          for k, x in r["train"].items())
    number = lambda key: f"{r[key]:.2f}" if isinstance(r.get(key), float) else ""
    lines.append(f"| `{name}` | {r.get('status', '?')} | {number('compile_s')} | "
                 f"{number('ms')} | {note.replace('|', '/')} |")
  return "\n".join(lines)


def write_table(doc: pathlib.Path, text: str) -> None:
  """`text` between the doc's gpu_check markers (appended with them where it has none)."""
  old = doc.read_text() if doc.exists() else ""
  block = f"{BEGIN}\n{text}\n{END}"
  if BEGIN in old and END in old:
    new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
  else:
    new = old.rstrip("\n") + "\n\n" + block + "\n"
  doc.write_text(new)


def check(dry: bool, budget: float, json_path: pathlib.Path, doc: pathlib.Path) -> dict:
  """Runs every piece in its own process within `budget` seconds; writes the report.

  Raises:
    SystemExit: not a dry run, and the first piece found no GPU (before anything
      else runs or is written: the GPU's shapes would take the whole budget on a CPU).
  """
  start = time.perf_counter()
  left = lambda: budget - (time.perf_counter() - start)
  # Pieces start faster without jax taking most of the GPU's memory at once.
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  reserve = min(BENCHMARK_S, budget / 2)
  results = {}
  for piece in _pieces(dry):
    skip = _skip_reason(piece, results)
    limit = min(LIMITS[piece.split(":")[0]], left() - reserve)
    if skip:
      results[piece] = {"status": "skipped", "why": skip}
    elif limit < 10:
      results[piece] = {"status": "skipped", "why": "the budget is spent"}
    else:
      command = [sys.executable, "-m", "allatt_jax.perf.gpu_check", f"--piece={piece}"]
      results[piece] = _spawn(command + (["--dry-run"] if dry else []), limit, env)
    print(f"{piece}: {json.dumps(results[piece])}", flush=True)
    found = results[piece]
    if piece == "versions" and not dry and found.get("backend") != "gpu":
      where = (f"jax runs on {found['backend']}" if found.get("backend") else
               f"jax did not start ({found.get('status')}: {found.get('error', '')})")
      raise SystemExit(
          f"gpu_check: {where} here, not on a GPU, so the check stops before its "
          "GPU-sized pieces. On a CPU run `launch/gpu_check.sh --dry-run`; on a GPU "
          "machine, install jax with CUDA (pip install -e .[cuda]).")
  stem = json_path.with_name(json_path.stem + "_benchmark")
  results["benchmark"] = (
      _benchmark(_benchmark_flags(results, dry), stem.with_suffix(".json"),
                 stem.with_suffix(".log"), left() - 5)
      if left() > 30 else {"status": "skipped", "why": "the budget is spent"})
  print(f"benchmark: {json.dumps(results['benchmark'])}", flush=True)
  report = {"date": datetime.date.today().isoformat(), "dry_run": dry, "budget_s": budget,
            "seconds": time.perf_counter() - start, "pieces": results}
  json_path.parent.mkdir(parents=True, exist_ok=True)
  json_path.write_text(json.dumps(report, indent=2) + "\n")
  write_table(doc, table(report))
  return report


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dry-run", action="store_true",
                      help="on a CPU: the XLA parts at tiny shapes, the tiny CPU benchmark")
  parser.add_argument("--budget", type=float, default=525.0, help="seconds for all pieces")
  parser.add_argument("--json", type=pathlib.Path, help="the report's JSON file")
  parser.add_argument("--doc", type=pathlib.Path, help="the Markdown file for its table")
  parser.add_argument("--out_dir", type=pathlib.Path,
                      help="a dry run's folder for both (default: a new temporary one)")
  parser.add_argument("--piece", help=argparse.SUPPRESS)   # one piece, in this process
  args = parser.parse_args(argv)
  if args.piece:
    report = lambda result: print(json.dumps(result), flush=True)
    report(gpu_pieces.run_piece(args.piece, args.dry_run, report))
    return
  date = datetime.date.today().isoformat()
  if args.dry_run:
    out_dir = args.out_dir or pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = args.doc or out_dir / "performance.md"
    if not doc.exists():
      doc.write_text((ROOT / "docs" / "performance.md").read_text())
    json_path = args.json or out_dir / f"gpu_check_{date}.json"
  else:
    doc = args.doc or ROOT / "docs" / "performance.md"
    json_path = args.json or ROOT / "docs" / "bench" / f"gpu_check_{date}.json"
  report = check(args.dry_run, args.budget, json_path, doc)
  print(table(report))
  print(f"report: {json_path}; table: {doc}")


if __name__ == "__main__":
  main()
