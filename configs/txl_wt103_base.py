r"""Transformer-XL baseline on WikiText-103, width as an argument (Shim et al. 2021, Fig. 3).

Same recipe and depth as wt103_base; a feed-forward sub-layer (d_ff = 4d) instead of
persistent vectors. The paper compares pruned All-att against d = 512, 480, 448, ...

  python -m allatt_jax.main --config=configs/txl_wt103_base.py:d_model=448 \
      --workdir=$WORKDIR --config.data.manual_dir=/path/to/wikitext-103

`configs/txl_wt103_base.py:tiny` is a 2-layer variant for tests and smoke runs.
"""
from allatt_jax.config import config_base


def get_config(arg=None):
  args = config_base.parse_arg(arg, d_model=512, tiny=False)
  c = config_base.load_sibling(__file__, "wt103_base.py", "tiny" if args.tiny else None)
  c.model.update(config_base.txl_model(64 if args.tiny else args.d_model))
  return c
