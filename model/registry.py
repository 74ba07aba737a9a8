"""Registries of the model's option axes: one self-describing entry per choice.

Each axis of `configs/validation.CHOICES` that the model implements
(`model.norm`, `model.pos_emb`, `model.mlp`, `model.attention_score`,
`model.attention_impl`, `model.rope_scaling`, `model.family`) has a
`Registry` in the module that implements it; an entry carries its module or
function, its closed-form parameter count, the config fields it reads and
what it needs of the attention. Generic code (the blocks, the stacks, the
accounting, `ModelConfig.forward_fields`, the attention dispatcher) reads the
entries instead of comparing names, so a new choice is its entry plus its
name in `CHOICES` (docs/extending.md); `python -m model.choices` prints
the table of them all that docs/models.md shows.

What an entry says is a promise the tests hold, each generated from the
registries so that a new entry is tested by being added (docs/extending.md):
`tests/test_registry.py` holds every registry's names equal to `CHOICES` and
walks every entry through the parameter count, causality, KV-cache decoding,
scanned layers and the Hugging Face export check; `tests/test_declarations.py`
runs every attention implementation on every feature it declares against
`reference`, and every norm and score against its definition;
`tests/test_mlp.py` every activation against transformers' `ACT2FN`. At
start-up `model.accounting.check_formula` refuses an entry whose closed-form
parameter count differs from its module's.
"""
from configs.errors import UserError


class Registry(dict):
  """Name -> entry for the config field `field` (e.g. "model.norm").

  Looking up a name with no entry is a `UserError` naming the field and the
  registered names (`ModelConfig.resolve` looks up every axis at start-up).
  """

  def __init__(self, field: str, entries=()):
    super().__init__()
    self.field = field
    for entry in entries:
      self.register(entry)

  def register(self, entry):
    """Adds `entry` (an object with a `name`) and returns it."""
    if entry.name in self:
      raise ValueError(f"{self.field}: {entry.name!r} is registered twice")
    self[entry.name] = entry
    return entry

  def __getitem__(self, name):
    if name not in self:
      raise UserError(f"config field {self.field}={name!r}: no registered entry of that name "
                      f"(registered: {', '.join(self)}); add one in the module that "
                      "registers them (docs/extending.md)")
    return super().__getitem__(name)

  def source(self, name: str) -> str:
    """The file that defines the kind of entry `name` (its dataclass, or the
    one that dataclass derives from), which is where its registry lives:
    "model/mlp.py" for an `MLPS` entry. Where a message sends the reader to
    fix the entry."""
    kind = type(self[name]).__mro__[-2]  # the base below `object`
    return kind.__module__.replace(".", "/") + ".py"

  def reads(self, chosen: str) -> set[str]:
    """The config fields (without `model.`) that entries other than `chosen`
    read and `chosen` does not: unused under this choice."""
    own = set(self[chosen].reads)
    return {field for name, entry in self.items() if name != chosen
            for field in entry.reads} - own

