"""One resolution of a run config, shared by every entry point.

train.py, compile.py, sweep.py, `python -m model.summary` and the bench
scripts call `resolve(config)` on the config their flags built, before
anything reads it, so that they derive the same run: the rules of
`configs/validation.py`, the budgets turned into steps, the parameter
formula checked and the model section resolved into the `ModelConfig`
every module reads. eval.py reads the config its run saved, which train.py
resolved. It lives in model/ rather than configs/ because the budgets are
counted in the model's FLOPs (`model/accounting.py`), and configs/ imports
nothing of the project.
"""
from configs.validation import validate
from model import accounting
from model.config import ModelConfig


def resolve(config):
  """`config` validated (`configs.validation.validate`), with train.num_steps
  and train.warmup_steps set by its budget (`accounting.with_budget`, which
  first checks the closed-form parameter count against the module's), and
  its model section resolved once (`ModelConfig.resolve`: the derived
  sizes, each layer's kind, what the chosen attention kernel takes; later
  calls on the same section reuse it). A budget makes it a copy; the given
  config is never changed. Resolving a resolved config changes nothing.
  Raises `UserError` for bad input."""
  validate(config)
  config = accounting.with_budget(config)
  ModelConfig.resolve(config.model)
  return config
