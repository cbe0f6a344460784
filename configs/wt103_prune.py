r"""Head pruning of a WikiText-103 baseline with L0 gates (Shim et al. 2021, §3-4).

Starts from a converged baseline (`init_from` its workdir), adds one gate per head at
π = 2, trains everything with NLL + λ(t)·L0 for 80K steps at peak learning rate 1e-3
(λ warmed up over 4K steps), and freezes the gates at step 16K so the rest of the run
fine-tunes the surviving heads. The pruned model is exported at the end.

Recipe sources (config_base.py lists each): the paper's where it states them, the
official code's where it is silent (official LAMB, gates at 10x the learning rate,
same_length, W_O bias, LayerNorm eps 1e-5, no final LayerNorm, q·P_K persistent
logits), output scaling s_g and masked empty memory kept on purpose.

  python -m allatt_jax.main \
      --config=configs/wt103_prune.py:lam=0.015,init_from=$BASELINE_WORKDIR \
      --workdir=$WORKDIR --config.data.manual_dir=/path/to/wikitext-103

Arguments: lam (0.01, 0.015, 0.02 in the paper), init_from, txl (prune a Transformer-XL
baseline instead, of width d_model), tiny.
"""
from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, lam=0.015, init_from="", txl=False, d_model=512,
                               tiny=False)
  base = "txl_wt103_base.py" if args.txl else "wt103_base.py"
  base_arg = ",".join(
      ([f"d_model={args.d_model}"] if args.txl else []) + (["tiny"] if args.tiny else []))
  c = config_base.paper_pruning(
      config_base.load_sibling(__file__, base, base_arg or None), args.lam, args.init_from)
  if args.tiny:
    c.gates.update(dict(l0_warmup_steps=5, freeze_step=10))
    c.train.update(dict(num_steps=20, warmup_steps=5))
  return c
