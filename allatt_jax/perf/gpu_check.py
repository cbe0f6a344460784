r"""The first thing a lent GPU runs (launch/gpu_check.sh): what the split core and its
persistent parts do there, each piece in a process of its own under a time limit, so
that a stalled compile costs that piece's seconds and the rest go on.

  python -m allatt_jax.perf.gpu_check              # on a GPU, within --budget (525 s)
  python -m allatt_jax.perf.gpu_check --dry-run    # on a CPU: the XLA parts at tiny
                                                   # shapes, the others' refusals

Pieces (gpu_pieces.py), each rate's layers first, a part's trial right before its
layers, each printing its result as a JSON line. A part that fails its trial at a
rate, or stalls, is not timed at that rate; cuDNN's is not with dropout
(persistent_cores.refusal). Then, in a process of its own:

  benchmark         python -m allatt_jax.benchmark --config=configs/bench_gpu.py:lease
                    --profile: the config (at dropout 0.2 the XLA core) and the split
                    core on the part whose split layer was fastest at 0.2, in the same
                    rounds, with at least BENCHMARK_S seconds; its JSON and log beside
                    the report's

After every piece it rewrites the report: its JSON and its Markdown table, so that a
run stopped at its limit keeps the pieces that finished (one stopped by SIGTERM also
ends the piece in flight and records it as 'stopped'). Where they go, first match:

  --out_dir=DIR, or $OUT    DIR/gpu_check_DATE.json and .md (the table), the
                            benchmark's report and log beside them ($OUT: the folder
                            whose files a lent GPU machine returns; nothing else does)
  --dry-run                 the same, in a new temporary folder
  otherwise                 docs/bench/gpu_check_DATE.json (--json), and the table
                            between the gpu_check markers of docs/performance.md (--doc)

  python -m allatt_jax.perf.gpu_check --table_from=REPORT.json   # a returned report's
                            table into docs/performance.md (--doc)
"""
import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import signal
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


class Stopped(Exception):
  """SIGTERM (the script's time limit) arrived while a piece ran."""


def _stop(signum, frame):
  del signum, frame
  # `timeout` sends its SIGTERM to its process group as well: a second one must not
  # interrupt the ending of the piece in flight.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  raise Stopped()


def _spawn(command, limit: float, env=None, log: pathlib.Path | None = None) -> dict:
  """A command under `timeout`: its last JSON line of output, or how it failed (its
  whole output also in `log`, if given); one stopped at its limit keeps its last JSON
  line under its status 'timeout'. Whatever interrupts the wait (Stopped) ends the
  command and its `timeout` alike before it propagates."""
  start = time.perf_counter()
  # A process group of its own (as `timeout` makes one anyway), ended as one: the
  # piece too, not only its `timeout`. The same session: a lent machine ends it too.
  process = subprocess.Popen(["timeout", "-k", "5", f"{max(limit, 1):.0f}", *command],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, process_group=0)
  try:
    stdout, stderr = process.communicate()
  except BaseException:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    raise
  seconds = time.perf_counter() - start
  if log:
    log.write_text(stdout + stderr)
  lines = stdout.strip().splitlines()
  result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
  if process.returncode in (124, 137):
    return {**result, "status": "timeout", "seconds": seconds, "limit_s": limit}
  if process.returncode:
    tail = (stderr.strip() or stdout.strip()).splitlines()[-3:]
    return {"status": "failed", "seconds": seconds, "error": " | ".join(tail)}
  return {"status": "ok", **result, "seconds": seconds}


def _part_of(piece: str) -> str | None:
  """The persistent part a piece runs (None: the XLA core alone, or no part)."""
  kind, *args = piece.split(":")
  if not args or (kind == "layer" and args[0] == "xla"):   # versions, benchmark
    return None
  return args[0].removeprefix("split-")


def _pieces() -> list[str]:
  """The pieces in the order they run: the training rate's layer timings first (what
  the split core is for), then each part's trial right before the layers that run it.
  A dry run has the same pieces: on a CPU the Pallas and cuDNN parts' say why not."""
  pieces = ["versions"]
  for rate in (0.2, 0.0):
    pieces += [f"layer:xla:{rate}"]
    for part in gpu_pieces.PARTS:
      pieces += [f"part:{part}:{rate}", f"layer:split-{part}:{rate}"]
  return pieces + [f"alone:{p}" for p in gpu_pieces.PARTS] + ["tiles:pallas:0.2"]


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


def _best_split(results: dict) -> str:
  """The persistent part of the fastest split core at dropout 0.2 (training's)."""
  timed = {p: results.get(f"layer:split-{p}:0.2", {}) for p in gpu_pieces.PARTS}
  ok = {p: r["ms"] for p, r in timed.items() if r.get("status") == "ok" and "ms" in r}
  return min(ok, key=ok.get) if ok else "xla"


def _benchmark_flags(results: dict, dry: bool) -> list[str]:
  """The benchmark's config, on a GPU `configs/bench_gpu.py:lease` (its five compiles
  fit BENCHMARK_S), on a CPU the tiny one, with its split variant on the persistent
  part whose split layer was fastest at dropout 0.2."""
  best = _best_split(results)
  split = f"--variant=split:model.attention_impl=split,model.persistent_impl={best}"
  if dry:
    return ["--config=configs/bench_cpu.py:tiny", "--config.benchmark.gated_steps=False",
            split]
  return ["--config=configs/bench_gpu.py:lease", split]


def _benchmark_summary(result: dict, flags: list[str], out: pathlib.Path) -> dict:
  """`result` of the benchmark's process with the rounds its report `out` holds (the
  benchmark rewrites it after each round, so a stopped one still gives those)."""
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


def _benchmark(flags: list[str], out: pathlib.Path, log: pathlib.Path,
               limit: float) -> dict:
  """The benchmark with `flags` (`_benchmark_flags`) and --profile: the config's
  train step and its variants' in the same rounds, summarized."""
  out.unlink(missing_ok=True)
  result = _spawn([sys.executable, "-m", "allatt_jax.benchmark", *flags, "--profile",
                   f"--out={out}"], limit, log=log)
  return _benchmark_summary(result, flags, out)


def table(report: dict) -> str:
  """The report as Markdown, for docs/performance.md."""
  v = report["pieces"].get("versions", {})
  lines = [f"{report['date']}, {v.get('device', '?')}, jax {v.get('jax', '?')}, CUDA "
           f"{v.get('cuda_runtime', '-')}, cuDNN {v.get('cudnn', '-')}"
           f"{' (dry run: CPU, tiny shapes)' if report['dry_run'] else ''}; "
           f"{report['seconds']:.0f} s in all"
           f"{'' if report.get('complete', True) else ', stopped before its end'}.", "",
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


def _replace(path: pathlib.Path, text: str) -> None:
  """`text` as the whole of `path`, written beside it and renamed over it."""
  partial = path.with_name(path.name + ".partial")
  partial.write_text(text)
  os.replace(partial, path)


def write_table(doc: pathlib.Path, text: str) -> None:
  """`text` between the doc's gpu_check markers (appended with them where it has none)."""
  old = doc.read_text() if doc.exists() else ""
  block = f"{BEGIN}\n{text}\n{END}"
  if BEGIN in old and END in old:
    new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
  else:
    new = old.rstrip("\n") + "\n\n" + block + "\n"
  _replace(doc, new)


@dataclasses.dataclass(frozen=True)
class Paths:
  """Where a check writes: its JSON, its table (`doc`: a Markdown file whose gpu_check
  markers take it, or None: `json` with the suffix .md, the table alone), and the
  benchmark's report and log (beside the JSON)."""
  json: pathlib.Path
  doc: pathlib.Path | None = None

  def write(self, report: dict) -> None:
    """The report's JSON and table, each replaced whole (a run killed while writing
    keeps the previous one)."""
    self.json.parent.mkdir(parents=True, exist_ok=True)
    _replace(self.json, json.dumps(report, indent=2) + "\n")
    if self.doc:
      write_table(self.doc, table(report))
    else:
      _replace(self.json.with_suffix(".md"), table(report) + "\n")

  @property
  def benchmark(self) -> pathlib.Path:
    return self.json.with_name(self.json.stem + "_benchmark")


def check(dry: bool, budget: float, paths: Paths) -> dict:
  """Runs every piece in its own process within `budget` seconds, rewriting the
  report (`paths`) after each; SIGTERM ends the piece in flight, records it as
  'stopped' and ends the check (SystemExit 124).

  Raises:
    SystemExit: not a dry run, and the first piece found no GPU (before anything
      else runs or is written: the GPU's shapes would take the whole budget on a CPU).
  """
  start = time.perf_counter()
  left = lambda: budget - (time.perf_counter() - start)
  # Pieces start faster without jax taking most of the GPU's memory at once.
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  reserve = min(BENCHMARK_S, budget / 2)
  report = {"date": datetime.date.today().isoformat(), "dry_run": dry, "budget_s": budget,
            "seconds": 0.0, "complete": False, "pieces": {}}
  results = report["pieces"]

  def record(piece, result):
    results[piece] = result
    report["seconds"] = time.perf_counter() - start
    print(f"{piece}: {json.dumps(result)}", flush=True)
    if piece != "versions" or dry or result.get("backend") == "gpu":
      paths.write(report)

  previous = signal.signal(signal.SIGTERM, _stop)
  piece, stopped = None, False
  try:
    for piece in _pieces():
      skip = _skip_reason(piece, results)
      limit = min(LIMITS[piece.split(":")[0]], left() - reserve)
      if skip:
        record(piece, {"status": "skipped", "why": skip})
      elif limit < 10:
        record(piece, {"status": "skipped", "why": "the budget is spent"})
      else:
        command = [sys.executable, "-m", "allatt_jax.perf.gpu_check", f"--piece={piece}"]
        record(piece, _spawn(command + (["--dry-run"] if dry else []), limit, env))
      found = results[piece]
      if piece == "versions" and not dry and found.get("backend") != "gpu":
        where = (f"jax runs on {found['backend']}" if found.get("backend") else
                 f"jax did not start ({found.get('status')}: {found.get('error', '')})")
        raise SystemExit(
            f"gpu_check: {where} here, not on a GPU, so the check stops before its "
            "GPU-sized pieces. On a CPU run `launch/gpu_check.sh --dry-run`; on a GPU "
            "machine, install jax with CUDA (pip install -e .[cuda]).")
    piece = "benchmark"
    flags = _benchmark_flags(results, dry)
    record(piece, _benchmark(flags, paths.benchmark.with_suffix(".json"),
                             paths.benchmark.with_suffix(".log"), left() - 5)
           if left() > 30 else {"status": "skipped", "why": "the budget is spent"})
  except Stopped:
    stopped = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    result = {"status": "stopped", "why": "SIGTERM: the script's time limit"}
    if piece == "benchmark":
      result = _benchmark_summary(result, flags, paths.benchmark.with_suffix(".json"))
    record(piece, result)
    raise SystemExit(124) from None
  finally:
    # Stopped, SIGTERM stays ignored to the end: `timeout` sends it to its process
    # group too, and a late one would end this process with its own status.
    if not stopped:
      signal.signal(signal.SIGTERM, previous)
  report["complete"] = True
  paths.write(report)
  return report


def _paths(args, date: str) -> Paths:
  """Where `main`'s check writes (the module's docstring)."""
  out_dir = args.out_dir or (pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT")
                             else None)
  if out_dir is None and args.dry_run:
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
  if out_dir is not None:
    return Paths(args.json or out_dir / f"gpu_check_{date}.json", args.doc)
  return Paths(args.json or ROOT / "docs" / "bench" / f"gpu_check_{date}.json",
               args.doc or ROOT / "docs" / "performance.md")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dry-run", action="store_true",
                      help="on a CPU: the XLA parts at tiny shapes, the tiny CPU benchmark")
  parser.add_argument("--budget", type=float, default=525.0, help="seconds for all pieces")
  parser.add_argument("--out_dir", type=pathlib.Path,
                      help="the folder for the report (default: $OUT where set)")
  parser.add_argument("--json", type=pathlib.Path, help="the report's JSON file")
  parser.add_argument("--doc", type=pathlib.Path, help="a Markdown file for its table")
  parser.add_argument("--table_from", type=pathlib.Path,
                      help="write this report's table into --doc (docs/performance.md)")
  parser.add_argument("--piece", help=argparse.SUPPRESS)   # one piece, in this process
  args = parser.parse_args(argv)
  if args.piece:
    report = lambda result: print(json.dumps(result), flush=True)
    report(gpu_pieces.run_piece(args.piece, args.dry_run, report))
    return
  if args.table_from:
    doc = args.doc or ROOT / "docs" / "performance.md"
    write_table(doc, table(json.loads(args.table_from.read_text())))
    print(f"table of {args.table_from}: {doc}")
    return
  paths = _paths(args, datetime.date.today().isoformat())
  report = check(args.dry_run, args.budget, paths)
  print(table(report))
  print(f"report: {paths.json}; table: {paths.doc or paths.json.with_suffix('.md')}")


if __name__ == "__main__":
  main()
