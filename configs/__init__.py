"""Run configs (`get_config(arg)` files); installed with the package as
allatt_jax.configs, where `--config=NAME.py` finds them from any folder."""
