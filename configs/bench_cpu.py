r"""The performance benchmark's model: a shallow WikiText-103-shaped All-att for a CPU.

Two layers of the paper's WikiText-103 layer (d=512, H=8, N=2048, T = S = 192) with the
paper's dropout, batch 8, and the attention core as it runs fastest on CPU: looping
over heads (head_block=1) and recomputing the attention weights in the backward pass
(remat, which on CPU costs no time and saves 40% of the step's memory). The
vocabulary is a plain 256-type tied softmax instead of WikiText-103's 267K-type
adaptive softmax, so that the benchmark measures the attention stack (the output
layer is 1.5% of the MACs here) rather than the softmax.

  python -m allatt_jax.benchmark --config=configs/bench_cpu.py --out=/tmp/bench.json

`configs/bench_cpu.py:tiny` is a seconds-long variant for tests.
"""
import ml_collections

from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, tiny=False)
  c = config_base.base_config()
  c.data.name = "wikitext103"
  c.model.update(dict(kind="allatt", vocab_size=256, num_layers=2, d_model=512,
                      num_heads=8, num_persistent=2048, head_block=1, remat=True))
  c.train.update(dict(batch_size=8, seq_len=192, mem_len=192))
  c.eval.update(dict(batch_size=8, seq_len=192, mem_len=192))
  c.gates.update(dict(lam=0.015, l0_warmup_steps=4000, freeze_step=16_000))
  # The benchmark's settings (allatt_jax/benchmark.py), in the config so that
  # --config.benchmark.rounds=... and the like can override them.
  c.benchmark = ml_collections.ConfigDict(dict(
      train_steps=5,               # timed steps per train-step variant and round
      eval_segments=5,             # timed segments per exported model and round
      rounds=5,                    # variants alternate within a round; medians reported
      heads_kept=(1.0, 0.75, 0.5, 0.25),
      matmul_size=2048,            # n of the n x n x n matmul taken as the peak
      gated_steps=True,            # also the gated and the distilling train steps
  ))
  if args.tiny:
    c.model.update(dict(d_model=32, num_heads=4, num_persistent=16))
    c.train.update(dict(batch_size=2, seq_len=8, mem_len=8))
    c.eval.update(dict(batch_size=2, seq_len=8, mem_len=8))
    c.benchmark.update(dict(train_steps=1, eval_segments=1, rounds=1, heads_kept=(1.0, 0.5),
                            matmul_size=256))
  return c
