"""The option registries (`model/registry.py`): their names are `CHOICES`, a bad
or unregistered choice is one line, and every entry is walked through the
checks a new variant must pass (parameter count, causality, KV-cache decoding,
scanned layers, the Hugging Face export refusal), so that adding an entry is
what tests it. A closed-form count that is off is refused at start-up, naming
the entry. What the entries declare of their math and of the attention
features they take: tests/test_declarations.py."""
import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base, validation
from configs.errors import UserError
from hf import convert as hf_convert
from model import accounting
from model.choices import choices_markdown
from model.config import REGISTRIES, ModelConfig
from model.mlp import MLPKind
from tests.test_scan import loop_and_scanned, model_cfg

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What an entry needs of the other fields to be built (a registry entry may add
# its own fields' values here).
NEEDS = {
    ("model.pos_emb", "relative"): dict(relative_buckets=8, relative_max_distance=16),
    **{("model.rope_scaling", name): dict(pos_emb="rope", rope_scaling_factor=2.0,
                                          rope_original_max_len=16)
       for name in REGISTRIES["model.rope_scaling"]},
    **{("model.moe_router", name): dict(num_experts=4, experts_per_token=2, moe_d_ff=16)
       for name in REGISTRIES["model.moe_router"]},
}

# The axes whose every entry builds a model (an attention implementation is
# checked against its kernels elsewhere: tests/test_flash_attention*.py).
WALKED = ("model.norm", "model.pos_emb", "model.mlp", "model.attention_score",
          "model.rope_scaling", "model.moe_router")
ENTRIES = [(field, name) for field in WALKED for name in REGISTRIES[field]]


def entry_overrides(field, name):
  return {field.split(".")[1]: name, **NEEDS.get((field, name), {})}


def test_registries_are_the_choices():
  for field, registry in REGISTRIES.items():
    assert tuple(registry) == validation.CHOICES[field], field


def test_docs_list_every_choice():
  """docs/models.md's table is `python -m model.choices`'s."""
  page = (ROOT / "docs" / "models.md").read_text()
  table = page.split("<!-- choices:start -->\n")[1].split("\n<!-- choices:end -->")[0]
  assert table == choices_markdown(), "rerun python -m model.choices into docs/models.md"


@pytest.mark.parametrize("field", [f for f in validation.CHOICES if f.startswith("model.")])
def test_a_typo_in_any_model_choice_is_one_line(field):
  m = base.get_config().model
  m[field.split(".")[1]] = "typo"
  with pytest.raises(UserError, match=rf"^config field {field}='typo': must be one of") as err:
    validation.validate_model(m)
  assert "\n" not in str(err.value)


def test_a_choice_without_an_entry_is_one_line(monkeypatch):
  monkeypatch.setitem(validation.CHOICES, "model.norm",
                      validation.CHOICES["model.norm"] + ("unregistered",))
  m = base.get_config().model
  m.norm = "unregistered"
  with pytest.raises(UserError, match=r"^config field model.norm='unregistered': no registered "
                                      r"entry of that name \(registered: ") as err:
    ModelConfig.resolve(m)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("field,name", ENTRIES)
def test_measured_parameters_equal_the_formula(field, name):
  experts = "num_experts" in entry_overrides(field, name)  # decoders only
  for family in ("decoder",) if experts else ("decoder", "encoder_decoder"):
    m = model_cfg(False, family=family, **entry_overrides(field, name))
    assert accounting.measured_params(m) == accounting.formula_params(m), family


def _miscounted(entry):
  """`entry` with a closed-form parameter count one too many."""
  if isinstance(entry, MLPKind):  # its count is a method
    class Miscounted(MLPKind):
      def params(self, d: int, f: int, bias: bool) -> int:
        return super().params(d, f, bias) + 1
    return Miscounted(**{f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)})
  return dataclasses.replace(entry, params=lambda *args: entry.params(*args) + 1)


@pytest.mark.parametrize("field,name,source", [("model.mlp", "swiglu", "model/mlp.py"),
                                               ("model.norm", "rmsnorm", "model/norms.py"),
                                               ("model.pos_emb", "learned", "model/positions.py")])
def test_a_wrong_closed_form_is_refused_naming_the_entry(monkeypatch, field, name, source):
  """Every entry point's `with_budget` checks the closed form against the
  module (`check_formula`) and names the entry whose count is off."""
  registry = REGISTRIES[field]
  m = model_cfg(False, mlp="swiglu", norm="rmsnorm", pos_emb="learned")
  accounting.check_formula(m)
  monkeypatch.setitem(registry, name, _miscounted(registry[name]))
  c = base.get_config()
  c.model = m
  with pytest.raises(UserError, match=rf"^config field {field}='{name}': its closed-form "
                     r"parameter count of [a-zA-Z' ]+, [\d,]+, differs from the module's [\d,]+ "
                     rf"\(model total [\d,]+ against [\d,]+\); fix the entry's params in "
                     rf"{source}$") as err:
    accounting.with_budget(c)
  assert "\n" not in str(err.value)


def test_a_wrong_formula_outside_the_entries_names_the_accounting(monkeypatch):
  monkeypatch.setattr(accounting, "_head_params", lambda m: 1)
  with pytest.raises(UserError, match=r"^model/accounting.py's closed-form parameter count "
                     r"differs from the module's in params_total \(model total"):
    accounting.check_formula(model_cfg(False))


# train.py with one entry's closed form off by one: refused before the workdir exists.
MISCOUNTED_TRAIN = """
import dataclasses, runpy, sys
from model.norms import NORMS
NORMS["rmsnorm"] = dataclasses.replace(NORMS["rmsnorm"], params=lambda dim: dim + 1)
sys.argv = ["train.py", "--config", "configs/tiny.py", "--workdir", sys.argv[1]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_train_refuses_a_wrong_closed_form_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  result = subprocess.run([sys.executable, "-c", MISCOUNTED_TRAIN, str(workdir)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith("error: config field model.norm='rmsnorm': its closed-form "
                                  "parameter count of a layer's norms, 258, differs from the "
                                  "module's 256 "), result.stderr
  assert result.stderr.count("\n") == 1, result.stderr
  assert not workdir.exists()


@pytest.mark.parametrize("field,name", ENTRIES)
def test_causal_cached_and_scanned_agree(field, name):
  """The decoder's logits do not see later tokens, KV-cache decoding token by
  token gives the full forward pass's logits, and the scanned stack gives the
  loop's."""
  looped, scanned = loop_and_scanned(**entry_overrides(field, name))
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)
  logits = looped(tokens)
  np.testing.assert_allclose(scanned(tokens), logits, atol=1e-5, rtol=1e-5)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 64)
  np.testing.assert_allclose(looped(changed)[:, :8], logits[:, :8], atol=1e-5, rtol=1e-5)
  cache = looped.init_cache(2, 12)
  for t in range(12):
    step_logits, cache = looped.decode_step(tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
    np.testing.assert_allclose(step_logits[:, 0], logits[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field,name", ENTRIES)
def test_export_maps_or_names_the_choice(field, name):
  """A choice either exports to a Hugging Face architecture that brings it
  back, or the export check names it (the LLaMA mapping's reason)."""
  overrides = entry_overrides(field, name)
  cfg = ModelConfig.resolve(model_cfg(False, **overrides))
  try:
    arch = hf_convert.export_architecture(cfg)
  except UserError as err:  # named: the choice, or a field it needs (model.num_experts)
    assert any(f"llama: model.{key}={value!r}" in str(err) for key, value in overrides.items())
  else:
    assert not hf_convert.round_trip_mismatch(arch, cfg)
