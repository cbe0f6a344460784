"""The demo's outputs that the README and docs/commands.md quote, made from a finished
demo workdir.

Each sits between `<!-- generated:NAME -->` and `<!-- end:NAME -->` (NAME: demo, score,
sample) in one of `QUOTING_FILES`; `generated_blocks` makes them from the workdir (its
report.json, and scoring and sampling its models as the docs' commands do),
`read_quoting_files` finds them and `rewrite_blocks` puts them in.
"""
import collections
import json
import pathlib
import re
import textwrap

from allatt_jax.reports import demo_report
from allatt_jax.config import errors
from allatt_jax.evaluation import likelihood
from allatt_jax.runs import run_files
from allatt_jax.evaluation import generation
from allatt_jax.runs import trained_model

# The demo folder the docs' commands use; outputs name it whatever the workdir.
README_WORKDIR = "/tmp/allatt_demo"
SCORED_TEXT = ("The town lies on the east bank of the river, where the old bridge "
               "crosses to the market and the church.")
SAMPLE_OPTIONS = dict(prompt="the city was founded in", num_tokens=120, temperature=0.7,
                      top_k=10, seed=0)
BLOCK_NAMES = ("demo", "score", "sample")
# Where the blocks are quoted, relative to the repository's root: the README shows the
# demo's table, the commands page the score and sample outputs.
QUOTING_FILES = ("README.md", "docs/commands.md")
_BLOCK = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- end:\2 -->)", re.S)


def rewrite_blocks(text: str, blocks: dict[str, str]) -> str:
  """`text` with the text between each pair of markers it holds replaced by blocks[NAME].

  Raises:
    ConfigError: markers for a block not in `blocks`.
  """
  unknown = {m.group(2) for m in _BLOCK.finditer(text)} - blocks.keys()
  if unknown:
    raise errors.ConfigError(
        f"Generated blocks {sorted(unknown)} have markers but no generator (this command "
        f"writes {sorted(blocks)}); remove their <!-- generated:NAME --> ... "
        "<!-- end:NAME --> markers.")
  return _BLOCK.sub(lambda m: m.group(1) + blocks[m.group(2)].rstrip("\n") + "\n"
                    + m.group(4), text)


def read_quoting_files(root) -> dict[pathlib.Path, str]:
  """{path: text} of `QUOTING_FILES` under the repository root `root`, checked to hold
  the markers of every block of `BLOCK_NAMES` once between them, before any is made.

  Raises:
    ConfigError: a file missing, or a block whose markers are missing, repeated or
      unknown.
  """
  root = pathlib.Path(root)
  missing = [name for name in QUOTING_FILES if not (root / name).is_file()]
  if missing:
    raise errors.ConfigError(
        f"{root} has no {' or '.join(missing)}: give the repository's root, whose "
        f"{' and '.join(QUOTING_FILES)} quote the demo's outputs.")
  texts = {root / name: (root / name).read_text() for name in QUOTING_FILES}
  counts = collections.Counter(dict.fromkeys(BLOCK_NAMES, 0))
  counts.update(m.group(2) for text in texts.values() for m in _BLOCK.finditer(text))
  wrong = {name: n for name, n in counts.items() if n != 1 or name not in BLOCK_NAMES}
  if wrong:
    raise errors.ConfigError(
        f"{' and '.join(QUOTING_FILES)} must hold the markers of each generated block "
        f"{list(BLOCK_NAMES)} once; found {dict(sorted(wrong.items()))} times. Add or "
        "remove <!-- generated:NAME --> ... <!-- end:NAME --> markers to match.")
  return texts


def _demo_block(report: dict) -> str:
  return f"```\n{demo_report.summary_table(report)}\n```\n"


def _score_block(baseline: trained_model.LoadedModel, pruned: trained_model.LoadedModel) -> str:
  summary, ids, log_probs = likelihood.score_text(baseline, SCORED_TEXT)
  pruned_summary = likelihood.score_text(pruned, SCORED_TEXT)[0]
  metric = baseline.tokenizer.metric
  shown = {"file": "my.txt", "checkpoint": f"{README_WORKDIR}/baseline",
           **{k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}}
  tokens = "\n".join(json.dumps({"position": i, "token": baseline.tokenizer.vocab[t],
                                 "log_prob": round(float(lp), 4)})
                     for i, (t, lp) in enumerate(zip(ids[1:3], log_probs[:2]), start=1))
  return (_wrap(f"With `my.txt` holding the line \"{SCORED_TEXT}\", the demo's "
                "baseline gives:")
          + f"\n\n```json\n{json.dumps(shown, indent=2)}\n```\n\n"
          + _wrap("(ppl instead of bpc for word-level data; `nll` is the mean in nats "
                  "per token). The pruned model "
                  f"(`--checkpoint={README_WORKDIR}/pruned/export`) gives "
                  f"{pruned_summary[metric]:.4f} {metric} on the same text. `--out` "
                  "writes one JSON line per scored token, its natural-log probability "
                  "given everything before it:")
          + f"\n\n```\n{tokens}\n```\n")


def _wrap(paragraph: str) -> str:
  return textwrap.fill(paragraph, width=84, break_long_words=False,
                       break_on_hyphens=False)


def _sample_block(pruned: trained_model.LoadedModel) -> str:
  o = SAMPLE_OPTIONS
  text = generation.sample_text(pruned, o["prompt"], o["num_tokens"],
                                temperature=o["temperature"], top_k=o["top_k"],
                                seed=o["seed"])["text"]
  return (f"```bash\npython -m allatt_jax.sample --checkpoint={README_WORKDIR}/pruned/"
          f"export \\\n    --prompt=\"{o['prompt']}\" --num_tokens={o['num_tokens']} "
          f"--temperature={o['temperature']} --top_k={o['top_k']} --seed={o['seed']}\n"
          "```\n\nprints the prompt (as the model reads it) and its continuation:\n\n"
          f"```\n{text}\n```\n")


def generated_blocks(workdir) -> dict[str, str]:
  """{NAME: markdown} of the demo in `workdir`.

  Raises:
    CheckpointError: `workdir` is not a finished demo workdir.
  """
  workdir = run_files.run_path(workdir)
  report_file = workdir / "report.json"
  if not report_file.is_file():
    raise errors.CheckpointError(
        f"{workdir} has no report.json: it is not a finished demo workdir. Run "
        f"python -m allatt_jax.main --config=configs/demo.py --workdir={workdir} first.")
  baseline = trained_model.load(workdir / "baseline")
  pruned = trained_model.load(workdir / "pruned" / "export")
  return {"demo": _demo_block(json.loads(report_file.read_text())),
          "score": _score_block(baseline, pruned), "sample": _sample_block(pruned)}
