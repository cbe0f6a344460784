r"""The performance benchmark on one accelerator: the paper's WikiText-103 model.

configs/wt103_base.py as it trains (16 layers, d=512, H=8, N=2048, T = S = 192, batch
96, the 267,735-type adaptive softmax, bf16 compute), timed in 3 rounds against an
8192³ matmul: a 2048³ one runs in tens of microseconds on a GPU, too short to time.
Inference, of the full model and of its pruned cuts, is timed at the training batch of
96 rows: at wt103_base.py's evaluation batch of 16 the GPU waits on each layer's fixed
costs, which pruning does not shrink (on an H200 on 2026-11-26, the model cut to half
its heads gained there 81% of the speed-up its MACs promise).
docs/performance.md has its figures on an H200. Arguments: `tiny` (wt103_base.py's),
and `lease`: what one 10-minute command on a lent GPU can time (2 rounds, all heads and
half, no gated steps, the variant `split`'s train step alone: four compiles of the 16
layers; docs/performance.md, "The lease benchmark's compiles").

  python -m allatt_jax.benchmark --config=configs/bench_gpu.py --profile --out=/tmp/bench_gpu.json
  python -m allatt_jax.benchmark --config=configs/bench_gpu.py:lease --profile

Its variant `before` times, in the same rounds, the code before the output layer and
the attention were rewritten for accelerators; its variant `split`, the split attention
core (split_core.py) with the persistent part that `persistent_impl='auto'` picks
(launch/gpu_check.sh times it with the part its layer timings found fastest).
"""
import ml_collections

from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, tiny=False, lease=False)
  c = config_base.load_sibling(__file__, "wt103_base.py", "tiny" if args.tiny else None)
  c.eval.batch_size = c.train.batch_size
  variants = dict(
      # The implementation before the output layer and the attention core were
      # rewritten for accelerators (a scan of 8,192-row vocabulary blocks with every
      # position through every tail cluster, float32 attention scores; `--profile`
      # adds its breakdown).
      before=dict(model=dict(vocab_block=8192, tail_capacity=0.0, score_dtype="float32",
                             attention_impl="xla")),
      # The context part in XLA, the persistent part merged by its log-sum-exp.
      split=dict(model=dict(attention_impl="split", persistent_impl="auto")))
  # --config.benchmark.rounds=... and the like can override them.
  c.benchmark = ml_collections.ConfigDict(dict(
      train_steps=5, eval_segments=5, rounds=3, heads_kept=(1.0, 0.75, 0.5, 0.25),
      matmul_size=8192, gated_steps=True,
      # Timed in the same rounds, as a ratio to the config.
      variants=variants))
  if args.lease:
    # What one 10-minute command on a lent GPU can time: on an H200 each train step
    # and evaluation of the 16 layers takes 35 to 60 s to compile and set up, and
    # the whole plan has eleven of them; this one four (the config's train step, its
    # evaluation with all heads and with half, the split variant's train step: on a
    # GPU the config's evaluation already runs the split core), within the device
    # check's 300 s at 60 s each.
    c.benchmark.update(dict(rounds=2, heads_kept=(1.0, 0.5), gated_steps=False,
                            variant_evaluations=False))
    c.benchmark.variants = ml_collections.ConfigDict(dict(split=variants["split"]))
  return c
