"""configs/cli.py: each command-line mistake is one line on stderr naming the
fix, exit status 2 (train.py's too, run as a user runs it); good flags parse as
absl and ml_collections parse them."""
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from configs import cli
from tests.helpers import ROOT


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
     "no such config file: configs/absent.py (the presets: configs/addition.py, "),
    (["--config=configs"], "no such config file: configs (the presets: configs/addition.py, "),
    (["--workdirr=runs/x"], "--workdirr: no such flag (see --help)"),
    (["--config", "configs/tiny.py", "--config.train.num_steps=many"],
     "--config.train.num_steps=many: expected an int, got 'many'\n"),
    (["--config", "configs/tiny.py", "--config.train.batch_size", "3.5"],
     "--config.train.batch_size=3.5: expected an int, got '3.5'\n"),
    (["--config", "configs/tiny.py", "--config.train.learning_rate=fast"],
     "--config.train.learning_rate=fast: expected a float, got 'fast'\n"),
    (["--config", "configs/tiny.py", "--config.train.allow_config_changes=yes"],
     "--config.train.allow_config_changes=yes: expected a bool (true or false), got 'yes'\n"),
    (["--config", "configs/tiny.py", "--config.data.seed=None"],  # None by default
     "--config.data.seed=None: expected an int, got 'None' (a field is set to None in a "
     "config file, not on the command line)\n"),
    (["--config", "configs/tiny.py", "--config.model.attention_scale=x"],  # None by default
     "--config.model.attention_scale=x: expected a float, got 'x'\n"),
    (["--config", "configs/tiny.py", "--config.data.labels=neg,pos"],
     "--config.data.labels=neg,pos: expected a tuple, e.g. (1, 2) or ('a', 'b'), got "
     "'neg,pos'\n"),
    (["--config", "configs/tiny.py", "--config.model.moe_layers=1 2"],
     "--config.model.moe_layers=1 2: expected a tuple, e.g. (1, 2) or ('a', 'b'), got '1 2'\n"),
])
def test_mistakes_are_one_line_naming_the_fix(monkeypatch, capsys, args, message):
  with pytest.raises(SystemExit) as exit_info:
    _parse(monkeypatch, *args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def _config_file(tmp_path, text: str) -> str:
  path = tmp_path / "my_config.py"
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("text,message", [
    ("import no_such_module_here\n",
     "{path} failed to import: ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("def get_config(:\n", "{path} failed to import: SyntaxError: invalid syntax ("
     "my_config.py, line 1)"),
    ("x = 1\n", "{path} has no get_config(): a config file defines one that returns the config "
     "(see configs/tiny.py)"),
    ("def get_config():\n  return undefined_name\n",
     "{path}: get_config() failed: NameError: name 'undefined_name' is not defined"),
    ("def get_config():\n  return None\n", "{path}: get_config() returned NoneType, not a "
     "ConfigDict"),
])
def test_a_config_file_that_fails_is_one_line_naming_the_cause(monkeypatch, capsys, tmp_path,
                                                               text, message):
  path = _config_file(tmp_path, text)
  with pytest.raises(SystemExit) as exit_info:
    _parse(monkeypatch, "--config", path)
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == f"error: {message.format(path=path)}\n"


def test_good_flags_parse(monkeypatch):
  rest, values = _parse(monkeypatch, "--config", "configs/tiny.py",
                        "--config.train.num_steps=7", "--max_new_tokens", "3", "extra")
  assert rest == ["train.py", "extra"]
  assert values.config.train.num_steps == 7
  assert values.max_new_tokens == 3


@pytest.mark.parametrize("args,field,value", [
    (["--config.train.batch_size", "8"], "train.batch_size", 8),
    (["--config.train.learning_rate=1"], "train.learning_rate", 1.0),
    (["--config.train.allow_config_changes"], "train.allow_config_changes", True),
    (["--config.train.allow_config_changes=false"], "train.allow_config_changes", False),
    (["--config.train.remat"], "train.remat", True),  # a policy name, or a bool for full/none
    (["--config.train.remat=save_dots"], "train.remat", "save_dots"),
    (["--config.data.seed=0x10"], "data.seed", 16),
    (["--config.data.labels=('neg', 'pos')"], "data.labels", ("neg", "pos")),
    (["--config.data.labels=neg"], "data.labels", ("neg",)),
    (["--config.data.labels=neg", "--config.data.labels=pos"], "data.labels", ("neg", "pos")),
    (["--config.model.moe_layers=1,2"], "model.moe_layers", (1, 2)),
    (["--config.data.paths=None"], "data.paths", "None"),  # a str field takes any text
])
def test_values_of_each_type_parse(monkeypatch, args, field, value):
  _, values = _parse(monkeypatch, "--config", "configs/tiny.py", *args)
  section, name = field.split(".")
  assert values.config[section][name] == value


@pytest.mark.parametrize("args,message", [
    (["--config", "configs/absent.py"], "error: no such config file: configs/absent.py (the "
     "presets: configs/addition.py, "),
    (["--config", "{bad}"], "error: {bad} failed to import: ModuleNotFoundError: No module "
     "named 'no_such_module_here'"),
    (["--config", "configs/tiny.py", "--config.train.batch_size=abc"],
     "error: --config.train.batch_size=abc: expected an int, got 'abc'"),
    (["--config", "configs/tiny.py", "--config.train.allow_config_changes=maybe"],
     "error: --config.train.allow_config_changes=maybe: expected a bool (true or false), got 'maybe'"),
    (["--config", "configs/tiny.py", "--num_steps=100"],
     "error: --num_steps: no such flag; the config field is --config.train.num_steps=100"),
    (["--config", "configs/tiny.py", "extra"], "error: unexpected arguments: extra (train.py "
     "takes --config, --workdir and --config.<field>=<value> flags only)"),
])
def test_train_py_exits_2_with_one_line(tmp_path, args, message):
  bad = _config_file(tmp_path, "import no_such_module_here\n")
  args = [a.format(bad=bad) for a in args]
  run = subprocess.run([sys.executable, "train.py", *args, "--workdir", str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert run.returncode == 2, run.stderr
  assert run.stderr.startswith(message.format(bad=bad)), run.stderr
  assert run.stderr.count("\n") == 1 and not run.stdout, run.stderr
  assert not (tmp_path / "run").exists()


def test_eval_py_extra_arguments_exit_2_with_one_line(tmp_path):
  run = subprocess.run([sys.executable, "eval.py", "--workdir", str(tmp_path), "extra"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert run.returncode == 2, run.stderr
  assert run.stderr == ("error: unexpected arguments: extra (eval.py takes --workdir and its "
                        "other flags only; --help lists them)\n")
  assert not run.stdout and not list(tmp_path.iterdir())
