r"""The paper's λ sweep and its TXL comparison on WikiText-2, sized for one accelerator.

One suite (allatt_jax/experiments/repro.py) trains an All-att baseline with the
paper's layer (d = 512, H = 8, dh = 64, N = 2048 persistent vectors, T = S = 192),
8 layers deep, on word-level WikiText-2 (the official files) with bf16 compute;
prunes it with L0 gates at three λ and scores each exported model; trains
Transformer-XLs of the same depth at three widths (d_ff = 4d); and writes a Table 1
and a Fig. 3 (test perplexity against non-embedding parameters) into the workdir.

  python -m allatt_jax.experiments --suite=repro --config=configs/repro_wt2.py \
      --config.data.manual_dir=data/wikitext-2 --workdir=workdir_repro --max_minutes=8

`--max_minutes` stops the training run in progress with a checkpoint and exits with
status 143; the same command resumes it bit-exactly. Repeat it until it exits 0
(docs/experiments.md has the steps for a GPU machine).

Recipe: the base config's (LAMB, gates, model details), with these choices for
WikiText-2: 33,278 types under an adaptive input/softmax with cutoffs 5K and 20K
(the head holds 87% of the training tokens, the tails 11% and 2.5%; widths 512,
128, 32); hidden and embedding dropout 0.3 instead of the paper's 0.1, since the
2.1M training tokens are 1/50 of WikiText-103's (attention dropout as the paper).
Baseline and TXLs: batch 96 (18,432 tokens a step, 113 steps an epoch), 4,000 steps
(35 epochs), warm-up 400 to 1e-2, cosine to 1e-4. Pruning runs: 2,000 steps at peak
1e-3 from the baseline, λ warmed up over 200 steps, gates frozen at step 1,000.

Step counts and time, ESTIMATED, not measured (no GPU was available when this was
written). Training FLOPs per token = 6 × the cost model's forward MACs
(python -m allatt_jax.costs): All-att and TXL d=512 236 MFLOP, TXL d=448 187, d=384 144.
Assuming 10% of the H100's dense bf16 peak (989 TFLOP/s; low because All-att's
softmax over S + T + N = 2,432 keys a query is memory-bound work that MACs do not
count), a step of 18,432 tokens takes 44 ms for All-att (22.7 steps/s, 420K
tokens/s), 35 and 27 ms for TXL d=448 and 384, and a pruning step
~48 ms (gates add ~10%):

  run                     steps   est. train min
  baseline (All-att)      4,000   2.9
  L0 λ = 0.01, 0.02, 0.04 2,000   1.6 each
  TXL d = 512, 448, 384   4,000   2.9, 2.3, 1.8
  total                   22,000  14.8, plus about 8 for compiles, evaluations,
                                  exports and restarts: ~23 min, 3 slices of 8 min.

Measured on one H200 (2026-11-26): the baseline trains at 18.4 steps/s (339K tokens/s,
8.1% of the bf16 dense peak), 81% of the 22.7 assumed above.

Measure the real rate first (a few minutes): `python -m allatt_jax.benchmark
--config=configs/repro_wt2.py` prints training tokens/s; steps/s = tokens/s / 18,432.
For a longer lease or a TPU slice, `configs/repro_wt2.py:scale=S` multiplies every
step count (warm-ups, freeze, evaluation and checkpoint intervals with them):
S = (training minutes available) / 14.8 × (measured All-att steps/s) / 22.7. On a
slice, the batch is sharded over all its chips (mesh.data = -1), so the steps/s to
use is the slice's.

`configs/repro_wt2.py:tiny` is the CPU variant the tests run end to end on a small
WikiText-2-shaped corpus (set data.manual_dir and model.vocab_size to it).
"""
import ml_collections

from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, scale=1.0, tiny=False)
  c = config_base.base_config()
  c.data.name = "wikitext2"
  c.model.update(dict(
      kind="allatt", vocab_size=33_278, num_layers=8, d_model=512, num_heads=8,
      num_persistent=2048, cutoffs=(5_000, 20_000), div_val=4,
      tie_projs=(False, True, True), dropout=0.3, dropout_emb=0.3, dtype="bfloat16"))
  c.train.update(dict(batch_size=96, seq_len=192, mem_len=192, num_steps=4000,
                      learning_rate=1e-2, final_learning_rate=1e-4, warmup_steps=400,
                      log_every_steps=100))
  c.eval.update(dict(batch_size=16, seq_len=192, mem_len=192, every_steps=1000))
  c.checkpoint.update(dict(every_steps=1000, keep=1))

  # Every run but the baseline and the TXLs starts from the baseline (see
  # allatt_jax/experiments/runs.py); gates train at the base config's learning rate.
  c.experiments = ml_collections.ConfigDict(dict(
      prune_train=dict(num_steps=2000, learning_rate=1e-3, warmup_steps=100),
      prune_gates=config_base.pruning_gates(init=2.0, l0_warmup_steps=200, freeze_step=1000),
      # The paper's WikiText-103 λ are 0.01-0.02; short gate phases need more (at CPU
      # scale 2-4x), hence 0.04 too.
      lambdas=(0.01, 0.02, 0.04),
      seeds=(0,),
      txl_widths=(512, 448, 384),
  ))
  if args.tiny:
    c.model.update(dict(num_layers=2, d_model=32, num_heads=4, num_persistent=128,
                        cutoffs=(40, 80), div_val=2, head_block=1, dtype="float32"))
    c.train.update(dict(batch_size=4, seq_len=16, mem_len=16, num_steps=40,
                        warmup_steps=5, log_every_steps=10))
    c.eval.update(dict(batch_size=8, seq_len=16, mem_len=16, every_steps=20))
    c.checkpoint.every_steps = 20
    e = c.experiments
    e.prune_train.update(dict(num_steps=60, warmup_steps=5))
    # Strong, early pressure so that a few tiny steps close heads.
    e.prune_gates.update(dict(l0_warmup_steps=10, freeze_step=40, learning_rate=0.1))
    # One run of each kind keeps the whole suite under two minutes of CPU.
    e.update(dict(lambdas=(0.2,), txl_widths=(32,)))
  _scale(c, args.scale)
  return c


def _scale(c: ml_collections.ConfigDict, factor: float) -> None:
  """Multiplies every step count and interval by `factor` (a longer or shorter lease)."""
  n = lambda steps: max(1, round(steps * factor))
  for section in (c.train, c.experiments.prune_train):
    section.num_steps, section.warmup_steps = n(section.num_steps), n(section.warmup_steps)
  g = c.experiments.prune_gates
  g.l0_warmup_steps, g.freeze_step = n(g.l0_warmup_steps), n(g.freeze_step)
  c.eval.every_steps, c.checkpoint.every_steps = (n(c.eval.every_steps),
                                                  n(c.checkpoint.every_steps))
