"""configs/cli.py: each command-line mistake is one line on stderr naming the
fix, exit status 2; good flags parse as absl and ml_collections parse them."""
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from configs import cli


def _values() -> flags.FlagValues:
  """The flags of a tool like train.py, in a FlagValues of their own."""
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "A configs/*.py file.", flag_values=values,
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory.", flag_values=values)
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.", flag_values=values)
  return values


def _parse(monkeypatch, *args):
  argv = ["train.py", *args]
  monkeypatch.setattr(sys, "argv", argv)  # ml_collections finds the overrides there
  values = _values()
  return cli.parse_flags(argv, values), values


@pytest.mark.parametrize("args,message", [
    (["--config", "configs/tiny.py", "--num_steps=100"],
     "--num_steps: no such flag; the config field is --config.train.num_steps=100"),
    (["--config", "configs/tiny.py", "--vocab_size=512"],
     "--vocab_size: no such flag; config fields of that name: --config.model.vocab_size, "
     "--config.tokenizer.vocab_size"),
    (["--config", "configs/tiny.py", "--max-new-tokens=3"],
     "--max-new-tokens: flags are snake_case: --max_new_tokens"),
    (["--config", "configs/tiny.py", "--config.train.num_stepz=3"],
     "command line: train.num_stepz: no such config field (did you mean train.num_steps?)"),
    (["--config", "configs/tiny.py", "--config.model.colour=red"],
     "command line: model.colour: no such config field"),
    (["--config.train.num_steps=3"], "--config.train.num_steps: give --config first"),
    (["--config", "configs/absent.py"],
     "--config configs/absent.py: cannot load it (no such file, or it fails to import); "
     "the presets: configs/addition.py, "),
    (["--workdirr=runs/x"], "--workdirr: no such flag (see --help)"),
    (["--config", "configs/tiny.py", "--config.train.num_steps=many"],
     "flag --config.train.num_steps=many: invalid literal for int() with base 10: 'many"),
])
def test_mistakes_are_one_line_naming_the_fix(monkeypatch, capsys, args, message):
  with pytest.raises(SystemExit) as exit_info:
    _parse(monkeypatch, *args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_good_flags_parse(monkeypatch):
  rest, values = _parse(monkeypatch, "--config", "configs/tiny.py",
                        "--config.train.num_steps=7", "--max_new_tokens", "3", "extra")
  assert rest == ["train.py", "extra"]
  assert values.config.train.num_steps == 7
  assert values.max_new_tokens == 3
