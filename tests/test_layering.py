"""The dependency arrows run one way: configs/ at the bottom, then data/, model/ and
tokenizer/, then training/, then hf/, aot/ and sweeps/ side by side.

Each import check runs in a fresh interpreter, so what a module pulls in is
what `sys.modules` shows, and an import cycle shows as an ImportError for the
module imported first. Importing a module does not run its functions, so
every import statement is read from the source too (`ast`), those inside
functions included.
"""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules(package: str) -> list[str]:
  paths = sorted((ROOT / package).rglob("*.py"))
  names = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in paths]
  return [n.removesuffix(".__init__") for n in names]


def _source(module: str) -> str:
  path = ROOT / module.replace(".", "/")
  return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def _run(code: str) -> None:
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr


def test_configs_never_import_model():
  """Importing every config module and validating every preset (one with the
  Mosaic GPU kernel chosen) loads nothing of model/."""
  _run(f"""
import importlib, sys
from configs.validation import validate
for name in {_modules("configs")!r}:
  module = importlib.import_module(name)
  if hasattr(module, "get_config") and name != "configs.base":
    validate(module.get_config())
config = importlib.import_module("configs.gpt2_small").get_config()
config.model.pallas_lowering = "mosaic_gpu"
validate(config)
pulled = sorted(m for m in sys.modules if m == "model" or m.startswith("model."))
assert not pulled, f"configs pulled in {{pulled}}"
""")


def test_every_model_module_imports_first():
  """Each module of model/ imported first into a clean `model` namespace: an
  import cycle inside model/ (or through configs/) would fail here."""
  _run(f"""
import importlib, sys
for name in {_modules("model")!r}:
  for loaded in [m for m in sys.modules if m.split(".")[0] in ("model", "configs")]:
    del sys.modules[loaded]
  importlib.import_module(name)
""")


# Which top-level packages each package may import: a floor imports only the
# floors below it. configs/ is the bottom; hf/, aot/ and sweeps/ sit side by
# side above training/, and only the entry points import them.
_ALLOWED = {
    "configs": set(),
    "data": {"configs"},
    "model": {"configs"},
    "tokenizer": {"configs", "data"},
    "training": {"configs", "data", "model", "tokenizer"},
    "hf": {"configs", "data", "model", "tokenizer", "training"},
    "aot": {"configs", "data", "model", "tokenizer", "training"},
    "sweeps": {"configs", "data", "model", "tokenizer", "training"},
}


# Modules inside a package that are entry points (`python -m ...`, named so in
# docs/architecture.md): above every floor, as train.py is, they may import any.
_ENTRY_POINTS = {"data/prepare.py"}


def _project_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, top-level package) of every absolute import statement of `path`
  that names a package of _ALLOWED, wherever it stands (inside functions too)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names = [node.module]
    else:
      continue
    found += [(node.lineno, name.split(".")[0]) for name in names
              if name.split(".")[0] in _ALLOWED]
  return sorted(found)


@pytest.mark.parametrize("package", sorted(_ALLOWED))
def test_no_import_statement_runs_up_a_floor(package):
  """No import statement of a module of `package`, at the top or inside a
  function, names a project package above it (file:line of each that does)."""
  wrong = []
  for path in sorted((ROOT / package).rglob("*.py")):
    relative = path.relative_to(ROOT).as_posix()
    if relative in _ENTRY_POINTS:
      continue
    wrong += [f"{relative}:{line} imports {name}" for line, name in _project_imports(path)
              if name != package and name not in _ALLOWED[package]]
  assert not wrong, f"{package} may import only {sorted(_ALLOWED[package])}: " + "; ".join(wrong)


def test_the_import_reader_sees_imports_inside_functions(tmp_path):
  path = tmp_path / "m.py"
  path.write_text("import os\nfrom configs import base\n\ndef f():\n  from model import "
                  "accounting\n  import training.loop, numpy\n  from . import x\n")
  assert _project_imports(path) == [(2, "configs"), (5, "model"), (6, "training")]


@pytest.mark.parametrize("package", sorted(_ALLOWED))
def test_no_import_runs_up_a_floor(package):
  """Importing every module of `package` loads no project package above it."""
  forbidden = sorted(set(_ALLOWED) - _ALLOWED[package] - {package})
  _run(f"""
import importlib, sys
for name in {_modules(package)!r}:
  importlib.import_module(name)
pulled = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
assert not pulled, f"{package} pulled in {{pulled}}"
""")


def test_every_file_parses_on_this_python():
  """Every .py of the repository compiles on the interpreter that runs the
  suite (the oldest the project supports: no newer syntax, such as a quote of
  the enclosing kind inside an f-string, in a script the suite never runs)."""
  skip = {".venv", "venv-cuda", ".git", "runs"}
  paths = []
  for folder, subfolders, files in os.walk(ROOT):
    subfolders[:] = [name for name in subfolders if name not in skip]  # never walked
    paths += [pathlib.Path(folder, name) for name in files if name.endswith(".py")]
  assert len(paths) > 100
  for path in paths:
    compile(path.read_text(), str(path), "exec")


def test_importing_the_library_starts_no_jax_backend():
  """A multi-process run calls jax.distributed.initialize() after train.py's
  imports, and JAX refuses it once a backend has started: no module of the
  library may make a JAX array (or ask for devices) when imported."""
  packages = ("configs", "data", "model", "tokenizer", "training", "hf", "aot", "sweeps")
  # Command-line modules define absl flags (twice would be an error); what
  # they import is imported here on its own.
  library = [m for p in packages for m in _modules(p)
             if "app.run(" not in _source(m)]
  _run(f"""
import importlib
import jax._src.xla_bridge as xla_bridge
for name in {library!r}:
  importlib.import_module(name)
  assert not xla_bridge._backends, f"importing {{name}} started JAX's backend"
""")
