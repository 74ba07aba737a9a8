"""The config of an existing run directory, for fine-tuning it:

  python train.py --config configs/from_run.py:runs/gpt2 \
      --config.train.restore_from=runs/gpt2 --workdir runs/gpt2_ft

Reads `<workdir>/config.json` (for example one written by `convert.py
from_hf`) over configs/base.py, so every field can still be overridden.
Without a workdir it is configs/base.py.
"""
import json
import os

from configs import base


def _update(section, values: dict) -> None:
  for key, value in values.items():
    if key in section and hasattr(section[key], "items") and isinstance(value, dict):
      _update(section[key], value)
    elif key in section:
      section[key] = tuple(map(tuple, value)) if key == "rules" else value


def get_config(workdir: str | None = None):
  c = base.get_config()
  if workdir is None:
    return c
  _update(c, base.BEFORE_FIELD)  # a field the saved config predates: as that run ran
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    _update(c, json.load(f))
  return c
