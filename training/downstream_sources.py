"""Which lm-eval tasks read data from the Hugging Face Hub, and whether they can.

Before eval.py --tasks or train.downstream_tasks loads a task (lm-eval's
`datasets.load_dataset`, which retries an unreachable Hub for a minute and
then ends in a traceback), `check` looks at every task named: the leaf tasks
of each group or tag, as lm-eval's TaskFactory expands them, and the dataset
each reads (`dataset_path`, `dataset_name`, remote `data_files`). A Hub
dataset already prepared in the local `datasets` cache loads offline; any
other needs the Hub, which is asked once, with a short timeout, at
HF_ENDPOINT. When a task cannot get its data, one `UserError` names the task,
the dataset and the two ways out: a local task, or the cache filled on a
connected machine and the offline variables set.

lm-eval's own tasks are looked up in a `QuickIndex` (the few of its 15,000
YAMLs that can define the names asked for) so that the check takes a second,
not the index of them all. Written against lm-eval 0.4.13's task index
(`lm_eval.tasks._index`), the version requirements-eval.txt pins.
"""
import dataclasses
import glob
import os
import pathlib
import re
import threading
from typing import NamedTuple

from configs.errors import UserError

_TOKEN = re.compile(r"[^\s'\"\[\]{},:#]+")  # what a YAML scalar naming a file can be
HUB_TIMEOUT_S = 5.0  # the most the Hub's answer is waited for
OFFLINE_VARIABLES = "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1"


class Source(NamedTuple):
  """A dataset on the Hub that a task reads: the repository, its config, and
  whether the task reads files of it (remote `data_files`, never cached)."""
  repo: str
  config: str | None
  files: bool = False


def _hub_repo(path: str) -> str | None:
  """The Hub repository `datasets.load_dataset(path)` reads, as datasets'
  `dataset_module_factory` decides (None: a local or packaged one)."""
  from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES  # pylint: disable=import-outside-toplevel
  from datasets.utils.file_utils import is_relative_path  # pylint: disable=import-outside-toplevel
  if path.startswith("hf://datasets/"):
    return "/".join(path.removeprefix("hf://datasets/").split("/")[:2]).split("@")[0]
  if path in _PACKAGED_DATASETS_MODULES or os.path.isdir(path):
    return None
  return path if is_relative_path(path) and path.count("/") <= 1 else None


def _remote_files(data_files) -> list[str]:
  """The URLs among a task's `data_files` (a path, a list, or split: paths)."""
  if isinstance(data_files, dict):
    return [f for value in data_files.values() for f in _remote_files(value)]
  if isinstance(data_files, (list, tuple)):
    return [f for value in data_files for f in _remote_files(value)]
  return [data_files] if isinstance(data_files, str) and "://" in data_files else []


def source(cfg: dict) -> Source | None:
  """What a leaf task's config reads from the Hub (None: nothing, or its own
  loader, `custom_dataset`, which is not looked into)."""
  if cfg.get("custom_dataset"):
    return None
  path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
  if "class" in cfg and not path:  # a Python task: its class names the dataset
    cls = cfg["class"]
    path, name = getattr(cls, "DATASET_PATH", None), getattr(cls, "DATASET_NAME", None)
  if not path:
    return None
  repo = _hub_repo(path)
  if repo is not None:
    return Source(repo, name)
  remote = _remote_files((cfg.get("dataset_kwargs") or {}).get("data_files"))
  if remote:
    return Source(_hub_repo(remote[0]) or remote[0], None, files=True)
  return None


def leaf_configs(index, name: str) -> list[dict]:
  """The config of every task `name` runs (a task, group or tag of `index`:
  a TaskManager's task_index or a QuickIndex), with the overrides its groups
  give, as lm-eval's TaskFactory builds them, without loading anything."""
  from lm_eval.config.group import GroupConfig  # pylint: disable=import-outside-toplevel
  from lm_eval.tasks._yaml_loader import load_yaml  # pylint: disable=import-outside-toplevel
  group_fields = {f.name for f in dataclasses.fields(GroupConfig)}
  out = []

  def task(entry, overrides):
    cfg = entry.cfg or {}
    if entry.kind.name == "PY_TASK":  # the class, imported (lm-eval imports it to run it)
      cfg = load_yaml(entry.yaml_path, resolve_func=True)
    out.append({**cfg, **overrides})

  def group(raw, overrides, seen):
    merged = {**{k: v for k, v in raw.items() if k not in group_fields}, **overrides}
    members = raw.get("task")
    for item in members if isinstance(members, list) else []:
      if isinstance(item, dict) and "group" in item:
        if item["group"] in index:
          visit(item["group"], {**merged, **{k: v for k, v in item.items() if k != "group"}},
                seen)
        else:  # a group defined inline
          group(item, merged, seen)
        continue
      member, member_overrides = ((item, merged) if isinstance(item, str)
                                  else (item.get("task"), {**merged, **item}))
      if member in index:
        visit(member, member_overrides, seen)
      else:  # a task defined inline
        out.append(member_overrides)

  def visit(member, overrides, seen):
    if member in seen:
      return
    entry, seen = index[member], seen | {member}
    if entry.kind.name == "TAG":
      for tagged in sorted(entry.tags):
        if tagged in index:
          task(index[tagged], overrides)
    elif entry.kind.name == "GROUP":
      group(entry.cfg or {}, overrides, seen)
    else:
      task(entry, overrides)

  visit(name, {}, frozenset())
  return out


class QuickIndex:
  """Task name -> lm-eval's index entry: `local`'s (a TaskManager's index of
  the local task directories) first, else that of lm-eval's own tasks.

  An own task's entry is the one lm-eval's TaskIndex would give it, found
  without parsing every YAML: a file can register a name (as task, group or
  tag) only if the name is in its text or in that of a file it includes, at
  any depth, so only those files are parsed, in TaskIndex's order, by
  TaskIndex itself. A file may include another if its text has `include`
  and names the other (a token that is its path, relative to the file's folder).
  """

  def __init__(self, local: dict, root: pathlib.Path | None = None):
    """`root`: the folder of lm-eval's own tasks (default: lm-eval's, as TaskManager reads it)."""
    from lm_eval.tasks import _index  # pylint: disable=import-outside-toplevel
    self._local, self._entries, self._configs = local, {}, {}
    root = root or pathlib.Path(_index.__file__).parent
    # TaskIndex's YAMLs in its order, by the path string that names them below.
    yamls = _index.TaskIndex._iter_yaml_files(root)  # pylint: disable=protected-access
    self._yamls = {str(path): path for path in yamls}
    self._texts = {}  # every file a YAML may include (all but Python), by path
    for folder, _, files in os.walk(root):
      for file in files:
        if not file.endswith((".py", ".pyc")):
          path = os.path.join(folder, file)
          with open(path, encoding="utf-8", errors="replace") as f:
            self._texts[path] = f.read()
    names = {os.path.basename(path) for path in self._texts}
    self._includers = {}  # file -> the files that name it
    for path, text in self._texts.items():
      for token in set(_TOKEN.findall(text)) if "include" in text else ():
        if token.rpartition("/")[2] in names:
          named = os.path.normpath(os.path.join(os.path.dirname(path), token))
          if named in self._texts and named != path:
            self._includers.setdefault(named, set()).add(path)

  def _candidates(self, name: str) -> list[pathlib.Path]:
    """The YAMLs that hold `name` or include (at any depth) a file that does."""
    found = {path for path, text in self._texts.items() if name in text}
    frontier = list(found)
    while frontier:
      new = self._includers.get(frontier.pop(), set()) - found
      found |= new
      frontier += new
    return [path for key, path in self._yamls.items() if key in found]

  def get(self, name: str):
    """`name`'s entry (None: no task, group or tag of that name)."""
    if name in self._local:
      return self._local[name]
    if name not in self._entries:
      from lm_eval.tasks._index import TaskIndex  # pylint: disable=import-outside-toplevel
      from lm_eval.tasks._yaml_loader import load_yaml  # pylint: disable=import-outside-toplevel
      index = {}
      for path in self._candidates(name):
        if path not in self._configs:
          try:
            self._configs[path] = load_yaml(path, resolve_func=False)
          except Exception:  # pylint: disable=broad-except
            self._configs[path] = None  # as TaskIndex.build: a YAML it cannot read is left out
        if self._configs[path] is not None:
          try:
            TaskIndex.process_cfg(self._configs[path], path, index)
          except Exception:  # pylint: disable=broad-except
            continue  # as TaskIndex.build
      self._entries[name] = index.get(name)
    return self._entries[name]

  def __contains__(self, name: str) -> bool:
    return self.get(name) is not None

  def __getitem__(self, name: str):
    entry = self.get(name)
    if entry is None:
      raise KeyError(name)
    return entry


def cached(src: Source, cache_dir: str) -> bool:
  """Whether `datasets` has `src` prepared in `cache_dir` (its
  HF_DATASETS_CACHE), which it loads from in offline mode
  (`CachedDatasetModuleFactory`: <namespace>___<name>/<config>/<version>/<hash>)."""
  if src.files:
    return False
  from datasets.naming import camelcase_to_snakecase  # pylint: disable=import-outside-toplevel
  parts = src.repo.split("/")
  parts[-1] = camelcase_to_snakecase(parts[-1])
  root = os.path.join(os.path.expanduser(cache_dir), "___".join(parts))
  configs = [src.config, f"{src.config}-*"] if src.config else ["*"]
  return any(glob.glob(os.path.join(glob.escape(root), c, "*", "*", "dataset_info.json"))
             for c in configs)


def hub_failure(endpoint: str) -> str | None:
  """Why the Hub at `endpoint` did not answer one HEAD request within
  HUB_TIMEOUT_S (None: it answered). The request runs in a thread of its own,
  so that a name lookup that hangs, which no HTTP timeout covers, cannot
  hold it up."""
  failure = [f"no answer in {HUB_TIMEOUT_S:g} s"]

  def ask() -> None:
    from huggingface_hub import get_session  # pylint: disable=import-outside-toplevel
    try:
      status = get_session().head(endpoint, timeout=HUB_TIMEOUT_S).status_code
      failure[0] = f"HTTP {status}" if status >= 500 else None
    except Exception as e:  # pylint: disable=broad-except
      # Whatever stops the request (refused, no route, DNS, TLS, proxy) is the answer.
      detail = " ".join(str(e).split())[:120]
      failure[0] = type(e).__name__ + (f": {detail}" if detail else "")

  thread = threading.Thread(target=ask, daemon=True, name="hub-probe")
  thread.start()
  thread.join(HUB_TIMEOUT_S + 1)
  return failure[0]


def _offline_variable() -> str | None:
  """The variable that puts `datasets` offline here (None: it is online)."""
  import datasets.config  # pylint: disable=import-outside-toplevel
  if not datasets.config.HF_HUB_OFFLINE:
    return None
  return "HF_DATASETS_OFFLINE" if os.environ.get("HF_DATASETS_OFFLINE") else "HF_HUB_OFFLINE"


def _describe(needs: dict) -> str:
  """'arc_easy needs allenai/ai2_arc (ARC-Easy), mmlu needs cais/mmlu (57 configs)'."""
  out = []
  for name, sources in needs.items():
    configs = {}
    for src in sources:
      configs.setdefault(src.repo + (" (its files)" if src.files else ""), set()).add(src.config)
    parts = []
    for repo, names in sorted(configs.items()):
      names.discard(None)
      detail = (f" ({next(iter(names))})" if len(names) == 1
                else f" ({len(names)} configs)" if names else "")
      parts.append(repo + detail)
    out.append(f"{name} needs {' and '.join(parts)}")
  return ", ".join(out)


def check(index, names, *, field: str, dir_field: str) -> None:
  """Refuses, in one line, tasks (of `index`, as in `leaf_configs`) whose Hub
  data can be had neither from the local cache nor from the Hub (asked once).
  Nothing is asked when no task needs the Hub, or in offline mode."""
  import datasets.config  # pylint: disable=import-outside-toplevel
  cache_dir = datasets.config.HF_DATASETS_CACHE
  needs = {}  # task name -> the Hub datasets it reads
  for name in names:
    sources = {s for s in map(source, leaf_configs(index, name)) if s is not None}
    if sources:
      needs[name] = sorted(sources, key=lambda s: (s.repo, s.config or ""))
  missing = {name: [s for s in sources if not cached(s, cache_dir)]
             for name, sources in needs.items()}
  missing = {name: sources for name, sources in missing.items() if sources}
  ways_out = (f"run a local task instead ({dir_field} with your task YAMLs, or python_next_line, "
              "which ships with the repository), or run the task once on a connected machine "
              f"and bring its Hugging Face cache (HF_HOME) here with {OFFLINE_VARIABLES} set")
  offline = _offline_variable()
  if offline:
    if missing:
      raise UserError(f"{field}: {_describe(missing)} from the Hugging Face Hub, not in the "
                      f"local cache ({cache_dir}), and {offline} is set; {ways_out}")
    return
  if not needs:
    return
  endpoint = datasets.config.HF_ENDPOINT
  failure = hub_failure(endpoint)
  if failure is None:
    return
  hub = f"the Hub ({endpoint}, HF_ENDPOINT) does not answer ({failure})"
  if missing:
    raise UserError(f"{field}: {_describe(missing)} from the Hugging Face Hub, not in the "
                    f"local cache ({cache_dir}), and {hub}; {ways_out}")
  raise UserError(f"{field}: {_describe(needs)} from the Hugging Face Hub, in the local cache "
                  f"({cache_dir}), but {hub}; set {OFFLINE_VARIABLES} to use the cached copy "
                  "without asking it")
