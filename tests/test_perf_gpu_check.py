"""The device check (launch/gpu_check.sh, allatt_jax/perf/gpu_check.py): its pieces at
a dry run's tiny shapes on this CPU (the Pallas and cuDNN parts' refusals here too),
which pieces it skips, where it writes, and that a check stopped at its limit keeps
what finished."""
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from allatt_jax.model.attention import persistent_cores
from allatt_jax.perf import gpu_check
from allatt_jax.perf import gpu_pieces

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_check_pieces_run_here_as_in_a_dry_run(tmp_path):
  """The device script's pieces (launch/gpu_check.sh), in this process at a dry run's
  tiny shapes, and the table it writes into docs/performance.md."""
  pieces = gpu_check._pieces()
  for piece in ("versions", "part:pallas:0.2", "part:cudnn:0.0", "layer:xla:0.2",
                "layer:split-pallas:0.2", "layer:split-cudnn:0.0", "alone:cudnn"):
    assert piece in pieces
  results = {}
  for piece in pieces:   # as the check runs them, less their processes
    skip = gpu_check._skip_reason(piece, results)
    results[piece] = ({"status": "skipped", "why": skip} if skip
                      else gpu_pieces.run_piece(piece, dry=True))
  assert results["versions"]["backend"] == "cpu"
  unavailable = lambda part: {"status": "unavailable",
                              "why": persistent_cores.why_not_here(part, jnp.float32, 16)}
  skipped = lambda why: {"status": "skipped", "why": why}
  untried = lambda rate: skipped(f"the part's trial at attention dropout {rate} did not "
                                 "pass (unavailable)")
  refused = skipped(persistent_cores.refusal("cudnn", 0.2, False))
  expected = {
      "part:pallas:0.2": unavailable("pallas"), "part:pallas:0.0": unavailable("pallas"),
      "part:cudnn:0.0": unavailable("cudnn"), "part:cudnn:0.2": refused,
      "layer:split-cudnn:0.2": refused, "layer:split-pallas:0.2": untried(0.2),
      "layer:split-pallas:0.0": untried(0.0), "layer:split-cudnn:0.0": untried(0.0),
      "alone:pallas": untried(0.0), "alone:cudnn": untried(0.0),
      "tiles:pallas:0.2": untried(0.2)}
  assert {piece: results[piece] for piece in expected} == expected
  for piece in set(pieces) - set(expected):
    assert results[piece].get("status", "ok") == "ok", (piece, results[piece])
  assert results["part:xla:0.2"]["agrees"] and results["layer:split-xla:0.2"]["ms"] > 0
  assert gpu_pieces.run_piece("layer:split-pallas:0.0", dry=True) == unavailable("pallas")
  assert gpu_check._best_split(results) == "xla"
  report = {"date": "2026-11-27", "dry_run": True, "seconds": 1.0,
            "pieces": {**results, "benchmark": {"status": "timeout", "limit_s": 1.0}}}
  doc = tmp_path / "performance.md"
  doc.write_text(f"# Performance\n\n{gpu_check.BEGIN}\nold\n{gpu_check.END}\n\nafter\n")
  for _ in range(2):
    gpu_check.write_table(doc, gpu_check.table(report))
  text = doc.read_text()
  assert text.count(gpu_check.BEGIN) == 1 and "old" not in text and text.endswith("after\n")
  assert "| `layer:split-xla:0.2` | ok |" in text and "| `benchmark` | timeout |" in text


def test_gpu_check_times_the_pallas_part_on_each_tiles_and_keeps_what_a_stall_leaves():
  """The tiles piece (a dry run: the first two tiles, in Pallas' interpreter) hands
  over its figures after each tiles; a piece stopped at its limit keeps its last
  line, and the table names the fastest tiles."""
  reports = []
  result = gpu_pieces.run_piece("tiles:pallas:0.2", dry=True, report=reports.append)
  names = [str(t) for t in gpu_pieces.TILE_CANDIDATES[:2]]
  assert [list(r["tiles"]) for r in reports] == [names[:1], names] and reports[-1] == result
  ms = {name: result["tiles"][name]["ms"] for name in names}
  assert result["best"] == min(ms, key=ms.get) and result["ms"] == ms[result["best"]]
  assert result["speedup"] == pytest.approx(ms[names[0]] / ms[result["best"]])
  assert "tiles:pallas:0.2" in gpu_check._pieces()
  assert "did not pass" in gpu_check._skip_reason("tiles:pallas:0.2", {})

  stalls = ("import json, time; print(json.dumps({'tiles': {'a': {}}, 'best': 'a'}), "
            "flush=True); time.sleep(60)")
  stopped = gpu_check._spawn([sys.executable, "-c", stalls], limit=3)
  assert stopped["status"] == "timeout" and stopped["best"] == "a", stopped
  row = next(line for line in gpu_check.table({
      "date": "d", "dry_run": True, "seconds": 1.0,
      "pieces": {"tiles:pallas:0.2": {**result, "status": "timeout"}}}).splitlines()
      if "`tiles:pallas:0.2`" in line)
  assert "| timeout |" in row and f"fastest of 2 tiles: {result['best']}," in row


def test_gpu_check_times_no_part_that_failed_its_trial_or_is_refused():
  """A part's trial runs right before its layers; a part that stalled or disagreed in
  its trial at a rate is not timed at that rate, nor cuDNN's with dropout."""
  pieces = gpu_check._pieces()
  for part in gpu_pieces.PARTS:
    for rate in gpu_pieces.RATES:
      assert pieces.index(f"part:{part}:{rate}") < pieces.index(f"layer:split-{part}:{rate}")
  assert pieces.index("layer:split-xla:0.2") < pieces.index("layer:xla:0.0")
  results = {"part:pallas:0.2": {"status": "timeout"},
             "part:pallas:0.0": {"status": "ok", "agrees": False},
             "part:xla:0.2": {"status": "ok", "agrees": True}}
  assert "(timeout)" in gpu_check._skip_reason("layer:split-pallas:0.2", results)
  assert "did not pass" in gpu_check._skip_reason("alone:pallas", results)
  assert "did not pass" in gpu_check._skip_reason("layer:split-xla:0.0", results)
  for piece in ("layer:split-xla:0.2", "layer:xla:0.2", "part:pallas:0.0", "versions"):
    assert gpu_check._skip_reason(piece, results) is None
  assert gpu_check._skip_reason("part:cudnn:0.2", {}) == persistent_cores.refusal(
      "cudnn", 0.2, False)


def test_gpu_check_times_the_split_train_step_on_the_fastest_split_layers_part():
  """The lease benchmark always has the split variant (its five compiles fit), on the
  part whose split layer was fastest at dropout 0.2."""
  layer = lambda ms: {"status": "ok", "ms": ms}
  results = {"layer:xla:0.2": layer(3.9), "layer:split-xla:0.2": layer(5.0),
             "layer:split-pallas:0.2": layer(7.1)}
  split = "--variant=split:model.attention_impl=split,model.persistent_impl="
  assert gpu_check._benchmark_flags(results, dry=False) == [
      "--config=configs/bench_gpu.py:lease", split + "xla"]
  results["layer:split-pallas:0.2"] = layer(1.9)
  assert gpu_check._benchmark_flags(results, dry=False)[-1] == split + "pallas"
  assert gpu_check._benchmark_flags({}, dry=True)[-1] == split + "xla"


def test_gpu_check_without_a_gpu_stops_after_its_first_piece(tmp_path, capsys):
  """Not a dry run on a CPU: the GPU-sized pieces would spend the whole budget; it
  stops with what to do once the versions piece finds no GPU, and writes nothing."""
  doc = tmp_path / "performance.md"
  doc.write_text("# Performance\n")
  with pytest.raises(SystemExit, match=r"^gpu_check: jax runs on cpu here, not on a GPU, .* "
                     r"On a CPU run `launch/gpu_check.sh --dry-run`"):
    gpu_check.check(False, 90.0, gpu_check.Paths(tmp_path / "report.json", doc))
  assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["versions"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["performance.md"]
  assert doc.read_text() == "# Performance\n"


def test_gpu_check_keeps_the_rounds_of_a_benchmark_stopped_at_its_limit(tmp_path,
                                                                       monkeypatch):
  out = tmp_path / "benchmark.json"
  out.write_text("{}")   # an earlier check's report: never taken for this one's
  stopped = {"status": "timeout", "seconds": 301.0, "limit_s": 300.0}
  monkeypatch.setattr(gpu_check, "_spawn", lambda *args, **kwargs: stopped)
  assert gpu_check._benchmark(["--config=c"], out, tmp_path / "b.log", 300) == stopped
  report = {"rounds_done": 1, "train": {"baseline": {"tokens_per_s": 300e3}},
            "variants": {"before": {"train": {"tokens_per_s": 100e3},
                                    "train_tokens_per_s_ratio": 1 / 3}}}
  def stopped_after_a_round(*args, **kwargs):
    out.write_text(json.dumps(report))
    return stopped
  monkeypatch.setattr(gpu_check, "_spawn", stopped_after_a_round)
  result = gpu_check._benchmark(["--config=c"], out, tmp_path / "b.log", 300)
  assert result == {**stopped, "flags": ["--config=c"], "rounds_done": 1, "report": str(out),
                    "train": {"xla": {"tokens_per_s": 300e3, "ratio": 1.0},
                              "before": {"tokens_per_s": 100e3, "ratio": 1 / 3}}}
  row = next(line for line in gpu_check.table({
      "date": "d", "dry_run": False, "seconds": 1.0,
      "pieces": {"benchmark": result}}).splitlines() if "`benchmark`" in line)
  assert "| timeout |" in row and "1 rounds: xla: 300,000 tokens/s (x1.00)" in row


def test_gpu_check_layer_pieces_need_no_command_packages():
  """The accelerator image lacks ml_collections, clu and TFDS: a layer piece runs
  without them (and without optax, orbax and etils)."""
  blocked = ("ml_collections", "clu", "tensorflow_datasets", "tensorflow", "optax", "orbax",
             "etils")
  script = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r}))\n"
            "from allatt_jax.perf import gpu_check\n"
            "gpu_check.main(['--piece=layer:split-xla:0.2', '--dry-run'])")
  done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "ok"


@pytest.mark.slow   # the CPU benchmark of configs/bench_cpu.py:tiny: a minute
def test_gpu_check_dry_run_end_to_end(tmp_path):
  done = subprocess.run([str(REPO / "launch" / "gpu_check.sh"), "--dry-run",
                         f"--out_dir={tmp_path}"], env={**os.environ, "PYTHON": sys.executable},
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(next(tmp_path.glob("gpu_check_*[0-9].json")).read_text())
  assert report["complete"]
  assert {r["status"] for r in report["pieces"].values()} == {"ok", "unavailable", "skipped"}
  assert all(r["status"] == "ok" for piece, r in report["pieces"].items()
             if gpu_check._part_of(piece) in (None, "xla"))
  assert "| `layer:split-xla:0.2` | ok |" in next(tmp_path.glob("gpu_check_*[0-9].md")).read_text()
  assert set(report["pieces"]["benchmark"]["train"]) == {"xla", "split"}
  benchmark = json.loads(next(tmp_path.glob("gpu_check_*_benchmark.json")).read_text())
  assert set(benchmark["train"]) == {"baseline", "flops_per_token"}   # gated_steps=False
  assert "variant split: train" in next(tmp_path.glob("gpu_check_*_benchmark.log")).read_text()
  assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".json", ".log", ".md"]


def test_gpu_check_writes_where_the_lent_machine_returns_files(tmp_path, monkeypatch):
  """Under $OUT (only what is written there comes back from a lent machine), else
  --out_dir, else a dry run's temporary folder, else docs/."""
  date = datetime.date.today().isoformat()
  args = lambda **kwargs: type("Args", (), {"out_dir": None, "json": None, "doc": None,
                                            "dry_run": False, **kwargs})
  monkeypatch.setenv("OUT", str(tmp_path / "out"))
  assert gpu_check._paths(args(), date) == gpu_check.Paths(
      tmp_path / "out" / f"gpu_check_{date}.json")
  assert gpu_check._paths(args(dry_run=True), date).json.parent == tmp_path / "out"
  assert gpu_check._paths(args(out_dir=tmp_path), date).json.parent == tmp_path
  monkeypatch.delenv("OUT")
  dry = gpu_check._paths(args(dry_run=True), date)
  assert dry.doc is None and dry.json.parent.name.startswith("gpu_check_")
  assert gpu_check._paths(args(), date) == gpu_check.Paths(
      REPO / "docs" / "bench" / f"gpu_check_{date}.json", REPO / "docs" / "performance.md")


def test_gpu_check_rewrites_its_report_after_every_piece_and_records_a_stop(tmp_path,
                                                                            monkeypatch):
  """Each piece's result is on disk before the next starts (a run killed at its limit
  keeps those); SIGTERM's Stopped, raised while a piece runs, is recorded for that
  piece and ends the check with status 124."""
  paths = gpu_check.Paths(tmp_path / "gpu_check.json")
  seen = []

  def spawn(command, limit, env=None, log=None):
    del command, limit, env, log
    on_disk = json.loads(paths.json.read_text())["pieces"] if paths.json.exists() else {}
    seen.append(list(on_disk))
    if len(seen) == 4:
      raise gpu_check.Stopped()
    return {"status": "ok", "backend": "cpu", "agrees": True}

  monkeypatch.setattr(gpu_check, "_spawn", spawn)
  handler = signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(SystemExit) as stop:
      gpu_check.check(True, 600.0, paths)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN   # ignored to the end
  finally:
    signal.signal(signal.SIGTERM, handler)
  assert stop.value.code == 124
  pieces = gpu_check._pieces()
  assert seen == [pieces[:i] for i in range(4)]   # no skips before the fourth spawn
  report = json.loads(paths.json.read_text())
  assert list(report["pieces"]) == pieces[:4] and not report["complete"]
  assert report["pieces"][pieces[3]] == {"status": "stopped",
                                         "why": "SIGTERM: the script's time limit"}
  assert "stopped before its end" in paths.json.with_suffix(".md").read_text()


def _pieces_running_here() -> list[int]:
  """Process ids of device-check pieces started from this checkout."""
  found = []
  for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
    try:
      if (b"--piece=" in cmdline.read_bytes()
          and os.readlink(cmdline.parent / "cwd") == str(REPO)):
        found.append(int(cmdline.parent.name))
    except OSError:   # ended while read
      continue
  return found


@pytest.mark.slow   # the dry run's first pieces: about half a minute
def test_gpu_check_dry_run_stopped_midway_keeps_the_pieces_that_finished(tmp_path):
  """launch/gpu_check.sh stopped as its time limit stops it (SIGTERM to its `timeout`)
  once a few pieces have finished: the report holds them, records the piece in flight
  as stopped, and that piece's process is ended."""
  script = subprocess.Popen(
      [str(REPO / "launch" / "gpu_check.sh"), "--dry-run", f"--out_dir={tmp_path}"],
      env={**os.environ, "PYTHON": sys.executable}, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  report_path = tmp_path / f"gpu_check_{datetime.date.today().isoformat()}.json"
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and script.poll() is None:
    if report_path.exists() and len(json.loads(report_path.read_text())["pieces"]) >= 3:
      break
    time.sleep(0.2)
  script.send_signal(signal.SIGTERM)
  output, _ = script.communicate(timeout=60)
  assert script.returncode == 124, output[-3000:]
  report = json.loads(report_path.read_text())
  statuses = [r["status"] for r in report["pieces"].values()]
  assert not report["complete"] and statuses[-1] == "stopped" and len(statuses) >= 4
  assert set(statuses[:-1]) <= {"ok", "unavailable", "skipped"}
  assert list(report["pieces"]) == gpu_check._pieces()[:len(statuses)]
  assert "stopped before its end" in report_path.with_suffix(".md").read_text()
  assert _pieces_running_here() == []


def test_a_returned_reports_table_goes_into_the_doc(tmp_path):
  report = {"date": "2026-12-01", "dry_run": False, "seconds": 300.0, "complete": False,
            "pieces": {"versions": {"device": "NVIDIA H100"},
                       "layer:xla:0.2": {"status": "ok", "ms": 3.9, "compile_s": 5.0}}}
  returned = tmp_path / "gpu_check_2026-12-01.json"
  returned.write_text(json.dumps(report))
  doc = tmp_path / "performance.md"
  doc.write_text(f"# Performance\n\n{gpu_check.BEGIN}\nold\n{gpu_check.END}\n")
  gpu_check.main([f"--table_from={returned}", f"--doc={doc}"])
  assert doc.read_text() == (f"# Performance\n\n{gpu_check.BEGIN}\n{gpu_check.table(report)}"
                             f"\n{gpu_check.END}\n")
  assert "2026-12-01, NVIDIA H100," in doc.read_text() and "stopped before its end" in doc.read_text()
