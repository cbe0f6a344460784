"""Exported models: a smaller model cut by `head_removal.remove_heads`, written and evaluated.

An exported model is a folder with its run config (of the smaller model), params,
tokenizer.json and vocabulary.json: usable on text without the training run or its
dataset (`trained_model.load`), and a start for another run (`init_from`). `save` is
its one writer; `export_and_evaluate` cuts, writes and scores a model; `export_run`
exports a pruning run's checkpoint; `trained_model_config` is a run's export's model.
"""
from collections.abc import Iterable, Mapping, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np

from etils import epath

from allatt_jax.pruning import budget
from allatt_jax.pruning import freeze
from allatt_jax.runs import checkpointing
from allatt_jax.config import console
from allatt_jax import data as data_lib
from allatt_jax.config import errors
from allatt_jax.pruning import gate_values
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import head_removal
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs import trained_model
from allatt_jax.runs import workdir_checks
from allatt_jax.data import tokenization

# A pruning run's own export: RUN/export.
EXPORT_DIR = "export"


def exported_config(config: run_config.RunConfig,
                    model_cfg: model_lib.ModelConfig) -> run_config.RunConfig:
  """The run's config describing the smaller model: per-layer head counts (and
persistent slots per head, where pruned), no gates, no init_from (and so no teacher),
so that every CLI that takes a checkpoint can load the export."""
  return run_config.derived_run(
      config, init_from="", gates=dict(enabled=False),
      model=dict(heads_per_layer=model_cfg.heads_per_layer,
                 persistent_slots=model_cfg.persistent_slots,
                 max_relative_len=model_cfg.max_relative_len),
      distill=dict(weight=0.0, hidden_weight=0.0))


def save(directory, config: run_config.RunConfig,
         model_cfg: model_lib.ModelConfig, params,
         tokenizer: tokenization.Tokenizer) -> None:
  """Writes the ungated model `model_cfg` with `params` as an exported model.

  Args:
    directory: the export's folder.
    config: the run config the model comes from (data, eval lengths); saved as
      `exported_config` describes it.
    model_cfg: the model's config (e.g. `head_removal.remove_heads`'s).
    params: its parameters, on the host.
    tokenizer: the tokenizer of its dataset, saved with its vocabulary's fingerprint.
  """
  exported = exported_config(config, model_cfg)
  directory = run_files.run_path(directory)
  checkpointing.save_params(directory, params)
  # In a multi-process run one process writes the files, and the others, which read
  # the model back next, wait for them.
  if jax.process_index() == 0:
    run_files.save_run(directory, exported,
                       run_files.vocabulary_fingerprint(tokenizer.dataset, tokenizer.vocab),
                       tokenizer.to_dict())
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"model_export.save {directory}")


def export_and_evaluate(
    directory, config: run_config.RunConfig, cfg: model_lib.ModelConfig,
    variables, corpus: data_lib.Corpus, mesh, *,
    heads: Mapping[int, Iterable[int]] | Sequence[np.ndarray] | None = None) -> dict:
  """Cuts `heads` (and a gated model's closed heads) out of a model, saves the smaller
  model once and scores its parameters, as they are in memory, on valid and test.

  Args:
    directory: the export's folder.
    config: the model's run config (its eval batch and lengths score the export).
    cfg: the model's config.
    variables: its variables, on the host.
    corpus: the dataset the model was trained on.
    mesh: where the evaluation runs.
    heads: as `head_removal.remove_heads` takes them.

  Returns:
    {split: metric value, '{split}_nll'} of valid and test, 'heads_per_layer' of the
    export and its 'directory'.
  """
  pruned_cfg, params = head_removal.remove_heads(cfg, variables, heads)
  return _save_and_evaluate(directory, config, cfg, pruned_cfg, params, corpus, mesh)


def _save_and_evaluate(directory, config: run_config.RunConfig,
                       cfg: model_lib.ModelConfig, pruned_cfg: model_lib.ModelConfig,
                       params, corpus: data_lib.Corpus, mesh) -> dict:
  """`export_and_evaluate` once `cfg` is cut to `pruned_cfg` with `params`."""
  renumbered = renumbering_note(cfg, pruned_cfg)
  save(directory, config, pruned_cfg, params, corpus.tokenizer)
  slots = pruned_cfg.layer_slots
  if jax.process_index() == 0:
    kept_slots = ("" if pruned_cfg.persistent_slots is None else
                  f", persistent vectors per layer {' '.join(map(str, slots))} of "
                  f"{' '.join(map(str, cfg.layer_slots))}")
    console.banner(f"Export: {sum(pruned_cfg.layer_heads)} of {sum(cfg.layer_heads)}"
                   f" heads kept (per layer {' '.join(map(str, pruned_cfg.layer_heads))}"
                   f"{kept_slots}) to {directory}; evaluating it")
    if renumbered:
      print(renumbered, flush=True)
  evaluator = stream_eval.Evaluator.from_config(model_lib.TransformerLM(pruned_cfg), mesh,
                                                config)
  results = stream_eval.evaluate_splits(evaluator, {"params": params}, corpus)
  results["heads_per_layer"] = list(pruned_cfg.layer_heads)
  if pruned_cfg.persistent_slots is not None:
    results["persistent_per_layer"] = slots
  results["directory"] = str(directory)
  return results


def renumbering_note(cfg: model_lib.ModelConfig,
                     pruned_cfg: model_lib.ModelConfig) -> str:
  """What a user of the export `pruned_cfg` of `cfg` should know of its heads'
  numbers (`head_removal.remove_heads` orders them), or '' where they are the same: each
  layer's heads are numbered anew, and the indices the API takes count them so."""
  if pruned_cfg.layer_heads == cfg.layer_heads and pruned_cfg.persistent_slots is None:
    return ""
  order = "in the order they had"
  if pruned_cfg.persistent_slots is not None:
    per_head = " | ".join(" ".join(map(str, layer)) for layer in pruned_cfg.persistent_slots)
    order = f"ordered by their persistent slots, most first (per head: {per_head})"
  return (f"The export numbers each layer's heads anew, 0 .. H-1: the heads kept, {order}. "
          "Model.prune_heads and prune_persistent_groups take those numbers, and "
          "Model.costs() lists each head's slots (persistent_per_head).")


def export_pruning_run(workdir, config: run_config.RunConfig, cfg: model_lib.ModelConfig,
                       variables, corpus: data_lib.Corpus, mesh, *,
                       decision: dict | None, gate_flags: str) -> dict:
  """A pruning run's final state exported to RUN/export and scored
  (`export_and_evaluate`), with the budget's `decision` at the freeze (None: a fixed
  λ) and the warnings of `pruning_warnings`, which are also printed.

  `variables`: on the host (`sharding.on_host`).
  """
  # The gates read once: the surgery cuts the heads they close, the warnings count
  # those they keep.
  gates = gate_values.read(cfg, variables["gates"])
  pruned_cfg, params = head_removal.cut_closed(cfg, variables["params"], gates)
  warnings = pruning_warnings(config, sum(cfg.layer_heads), sum(pruned_cfg.layer_heads),
                              decision, gate_flags)
  results = _save_and_evaluate(run_files.run_path(workdir) / EXPORT_DIR, config, cfg,
                               pruned_cfg, params, corpus, mesh)
  results["budget"] = decision
  results["warnings"] = warnings
  if jax.process_index() == 0:
    print(stream_eval.results_line("exported model", results, corpus.metric), flush=True)
    for warning in results["warnings"]:
      print(f"warning: {warning}", flush=True)
  return results


def pruning_warnings(config: run_config.RunConfig, total: int, kept: int,
                     decision: dict | None, gate_flags: str) -> list[str]:
  """What a user should know about a pruning run's outcome (`kept` of `total` heads;
  the budget's `decision`, None for a fixed λ), with the flag to turn.

  `gate_flags`: how the caller's command line names the gates section
  (--config.gates, or a pipeline's --config.pipeline.prune_gates).
  """
  gates = config.gates
  # Every caller's train section sits beside its gates section, with the same prefix.
  train_flags = gate_flags.replace("gates", "train")
  if decision is None:
    if not kept:
      return [f"pruning removed every one of the {total} heads (λ={gates.lam}): the "
              f"exported model has no attention. Lower {gate_flags}.lam, or ask for a "
              f"size with {gate_flags}.target_sparsity=0.5 (or target_params, "
              "target_macs)."]
    if kept < total:
      return []
    return [f"pruning removed no head of {total} (λ={gates.lam}). Ask for a size with "
            f"{gate_flags}.target_sparsity=0.5 (or target_params, target_macs), or "
            f"raise {gate_flags}.lam."]
  if "groups" in decision:
    return _group_budget_warnings(config, decision, total, gate_flags)
  if decision["allowed"] == total:
    return [f"the budget {gate_flags}.{gates.budget_shown} allows all {total} heads, so "
            "pruning removed none; ask for a smaller size."]
  if not decision["allowed"]:
    return [f"the budget {gate_flags}.{gates.budget_shown} keeps none of the "
            f"{total} heads ({gate_flags}.allow_empty=True): the exported model has no "
            "attention."]
  if abs(decision["by_gates"] - decision["allowed"]) >= max(2, total // 10):
    return [f"the gates alone kept {decision['by_gates']} heads at the freeze, far from "
            f"the budget's {decision['allowed']}: to keep exactly those, the budget "
            f"reversed {decision['changed']} of the gates' decisions by logit rank. To "
            "let the gates decide, give them more steps to settle "
            f"before they freeze: a later {gate_flags}.freeze_step (now "
            f"{gates.freeze_step}, with {train_flags}.num_steps after it), or a longer target "
            f"warm-up, {gate_flags}.budget_warmup_steps (now "
            f"{budget.target_warmup_steps(gates.budget_warmup_steps, gates.freeze_step)})."]
  return []


def _group_budget_warnings(config: run_config.RunConfig, decision: dict, total: int,
                           gate_flags: str) -> list[str]:
  """`pruning_warnings` of a budget over heads and persistent groups
  (`freeze.keep_within_budget`'s decision)."""
  gates = config.gates
  asked = f"{gate_flags}.{gates.budget_shown}"
  per_head = config.model.num_persistent // gates.persistent_group
  if decision["allowed"] == total and decision["groups"] == total * per_head:
    return [f"the budget {asked} allows all {total} heads and {total * per_head} "
            "persistent groups, so pruning removed nothing; ask for a smaller size."]
  if not decision["allowed"]:
    return [f"the budget {asked} keeps none of the {total} heads ({gate_flags}."
            "allow_empty=True): the exported model has no attention."]
  warnings = []
  if freeze.keeps_every_group(decision, per_head):
    warnings.append(
        f"the budget {asked} kept {decision['allowed']} of {total} heads, each with all "
        f"its persistent slots: no persistent group was pruned (the gates alone kept "
        f"{decision['groups_by_gates']} groups of their {decision['by_gates']} heads), "
        "so the heads alone met the budget. To prune persistent groups rather than "
        f"heads, gate the groups alone: {gate_flags}.heads=False.")
  off = abs(decision["cost_by_gates"] - decision["cost"])
  if off >= 0.1 * decision["budget"]:
    warnings.append(
        f"the gates alone kept a model of {decision['cost_by_gates']:,.0f} at the "
        f"freeze, far from the budget's {decision['budget']:,.0f}: to fit it, the "
        f"budget reversed {decision['changed']} of the gates' decisions by logit "
        f"rank. To let the gates decide, give them more steps to settle before "
        f"they freeze: a later {gate_flags}.freeze_step (now {gates.freeze_step}), or "
        f"a longer target warm-up, {gate_flags}.budget_warmup_steps.")
  return warnings


def trained_model_config(checkpoint, step: int | None = None
                         ) -> tuple[run_config.RunConfig, model_lib.ModelConfig]:
  """(run config, the model as it runs) of a run's workdir or an export: an export's
  heads, or a run's with its closed gates removed (the heads its export would keep)."""
  config, variables, _ = checkpointing.read_model(checkpoint, step)
  return config, head_removal.running_model_config(model_lib.ModelConfig.from_config(config),
                                                   variables)


def export_run(workdir, out_dir=None, step: int | None = None, *,
               overwrite: bool = False) -> epath.Path:
  """Exports a pruning run's checkpoint `step` (default: the newest that restores) as
  a standalone smaller model; a run saved without its tokenizer gets its dataset's.

  Returns the export's folder: `out_dir`, else `default_export_dir`.

  Raises:
    CheckpointError: not a pruning run, or no such (readable) checkpoint.
    FlagError: the folder holds something already, and `overwrite` is not set; or it
      holds something other than an exported model.
  """
  workdir = run_files.run_path(workdir)
  workdir_checks.check_export(workdir)
  if out_dir:   # checked before the model is read
    out_dir = run_files.run_path(out_dir)
    _check_target(out_dir, overwrite)
  model = trained_model.load(workdir, step)
  config, step = model.config, model.step
  pruned_cfg, params = head_removal.remove_heads(model.lm.cfg, jax.device_get(model.variables))
  if not out_dir:
    # Named after the step that restored: checked once that is known, before any write.
    out_dir = default_export_dir(workdir, config, step)
    _check_target(out_dir, overwrite)
  save(out_dir, config, pruned_cfg, params, model.tokenizer)
  return out_dir


def default_export_dir(workdir, config: run_config.RunConfig,
                       step: int) -> epath.Path:
  """RUN/export for the run's final step, the folder its own export went to, and
  RUN/export-step-N for an earlier one."""
  return workdir / (EXPORT_DIR if step == config.train.num_steps
                    else f"{EXPORT_DIR}-step-{step}")


def existing_target(out_dir) -> str:
  """What a folder a model is about to be written to holds: '' (nothing: missing or
  empty), 'model' (an exported model, which an overwrite may replace) or 'other'
  (never replaced: it could be the run itself)."""
  out_dir = run_files.run_path(out_dir)
  if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
    return ""
  return "model" if (out_dir / "params").is_dir() else "other"


def _check_target(out_dir: epath.Path, overwrite: bool) -> None:
  found = existing_target(out_dir)
  if found == "other":
    raise errors.FlagError(f"{out_dir} exists and is not an exported model; give a new "
                           "or empty folder with --out=DIR.")
  if found and not overwrite:
    raise errors.FlagError(
        f"{out_dir} already holds an exported model (a run's results.json and a demo's "
        "report.json describe the run's own). Write this one elsewhere with --out=DIR, "
        "or replace it with --overwrite.")
