"""Downstream evaluation: lm-evaluation-harness (`lm-eval`) tasks on our decoders.

`harness_model` wraps a decoder and its tokenizer as an lm-eval model (its
`LM` interface), so that any lm-eval task runs on a checkpoint: eval.py
`--tasks` and, in the training loop, `train.downstream_tasks`
(docs/downstream.md). lm-eval is optional: it is imported only here, on
first use, and its absence is a one-line `UserError` with the install hint.

How a request is scored, as lm-eval's own `hf` model does it (so the same
weights give the same numbers, `tests/test_downstream.py`):

- `loglikelihood(context, continuation)`: lm-eval's `TemplateLM` splits the
  pair into tokens (the context's trailing spaces move to the continuation;
  context + continuation is encoded whole and the context's tokens cut off,
  BOS first as our runs start a document; an empty context is the BOS alone).
  The row is context + continuation without its last token, cut from the
  left to `model.max_len` tokens; the sum of the continuation's log-probs
  and whether each of its tokens is the argmax are returned.
- `loglikelihood_rolling(text)`: the text's tokens after BOS in windows of
  `model.max_len` predictions (lm-eval's rolling windows, each token
  predicted once with as much context as fits), summed. lm-eval's `hf`
  model scores the BOS its tokenizer adds too; we score the text only.
- `generate_until(context, kwargs)`: KV-cache generation
  (`model/generate.py`) from the context's last `max_len - max_gen_toks`
  tokens, greedy or sampled as the task asks; the text stops at EOS and is
  cut before the first stop sequence (`until`).

Rows are batched, longest first, `batch_size` at a time and right-padded with
segment id 0 (so padding takes no attention and, in a mixture of experts, no
expert); every batch has `batch_size` rows and a width rounded up to a power
of two, so that a few compiled programs serve a whole task.
"""
import difflib
import functools
import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import validation
from configs.errors import UserError
from model.generate import generate
from training import downstream_sources

INSTALL = "make install-eval (pip install -r requirements-eval.txt)"
# The repository's own tasks (python_next_line), on lm-eval's include path always.
TASK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
MIN_WIDTH = 16  # the narrowest padded row
DEFAULT_MAX_GEN_TOKS = 256  # new tokens of a generate_until task that names none (lm-eval's)
_SAMPLING = ("temperature", "top_k", "top_p")  # generation arguments our sampler takes


def require_lm_eval(where: str):
  """The `lm_eval` module; a one-line UserError naming `where` if it is not installed."""
  try:
    import lm_eval  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise UserError(f"{where} runs lm-evaluation-harness tasks, which is not installed: "
                    f"run {INSTALL}") from None
  return lm_eval


class Tasks(NamedTuple):
  """lm-eval tasks to run: their names and the lm-eval TaskManager that knows them."""
  names: tuple[str, ...]
  manager: object  # lm_eval.tasks.TaskManager


def load_tasks(value: str, task_dir: str = "", *, field: str = "train.downstream_tasks",
               dir_field: str = "train.downstream_task_dir") -> Tasks:
  """The tasks named in the comma-separated `value`: lm-eval's own, the
  repository's (TASK_DIR) and the YAMLs of `task_dir`. A name lm-eval does not
  know is one line, naming `field` and the closest names; so is a task whose
  Hugging Face data is neither cached nor reachable (`downstream_sources`).
  Both are known before lm-eval's own tasks (about 15,000 YAMLs, seconds to
  index) are indexed, which they are only to run one of them."""
  names = validation.downstream_task_names(value, field)
  require_lm_eval(field)
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  if task_dir and not os.path.isdir(task_dir):
    raise UserError(f"{dir_field}={task_dir!r}: no such directory; give the directory that "
                    "holds your task YAMLs")
  local = [TASK_DIR] + ([task_dir] if task_dir else [])
  manager = TaskManager(include_path=local, include_defaults=False)
  index = manager.task_index
  if not set(names) <= set(manager.all_tasks):
    index = downstream_sources.QuickIndex(manager.task_index)
  for name in names:
    if name not in index:
      close = difflib.get_close_matches(name, TaskManager(include_path=local).all_tasks, n=3)
      what = (f"neither a task of {dir_field}={task_dir!r} nor an lm-eval task" if task_dir
              else "not an lm-eval task")
      raise UserError(f"{field}: {name!r} is {what}"
                      + (f" (closest: {', '.join(close)})" if close else "")
                      + "; `lm-eval ls tasks` lists lm-eval's"
                      + ("" if task_dir else f", {dir_field} adds your own task YAMLs"))
  downstream_sources.check(index, names, field=field, dir_field=dir_field)
  if index is not manager.task_index:  # lm-eval's own tasks: its whole index, to run them
    manager = TaskManager(include_path=local)
  return Tasks(names, manager)


def training_tasks(config) -> Tasks | None:
  """train.downstream_tasks, looked up before training starts (None: none).
  The loop scores them in its one process; a multi-process run evaluates its
  checkpoints with eval.py --tasks instead."""
  t = config.train
  if not t.downstream_tasks:
    return None
  if jax.process_count() > 1:
    raise UserError(f"config field train.downstream_tasks={t.downstream_tasks!r}: runs in "
                    f"single-process training only, this run has {jax.process_count()} "
                    "processes; unset it and evaluate the checkpoints with eval.py --tasks")
  return load_tasks(t.downstream_tasks, t.downstream_task_dir)


def _width(longest: int, cap: int) -> int:
  """Padded width of a batch whose longest row has `longest` tokens: the next
  power of two, at least MIN_WIDTH, at most `cap` (and at least `longest`)."""
  return max(longest, min(cap, max(MIN_WIDTH, 1 << (longest - 1).bit_length())))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_scores(graphdef, params, tokens_BT, targets_BT, segment_ids_BT):
  """(log p of every target [B, T], whether it is the most likely token [B, T])."""
  logits_BTV = nnx.merge(graphdef, params)(tokens_BT, segment_ids=segment_ids_BT)
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return logp_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT


class CheckpointLM:
  """lm-eval's language-model interface over one of our decoders and its tokenizer.

  The methods lm-eval's `TemplateLM` asks for; `harness_model` makes the
  subclass of it that lm-eval runs (lm-eval is imported there, not here).
  One process, all requests (lm-eval's rank 0 of 1).
  """

  def __init__(self, model, model_cfg, tok, *, batch_size: int):
    super().__init__()  # lm-eval's TemplateLM
    self._model, self._model_cfg, self._tok = model, model_cfg, tok
    self._graphdef, self._params = nnx.split(model)
    self.batch_size = batch_size
    self.max_length = model_cfg.max_len

  @property
  def eot_token_id(self) -> int:
    return self._tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context is, and what the first rolling window starts from."""
    return self._tok.bos_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
    """Token ids of `string`, BOS first unless `add_special_tokens` is False."""
    if add_special_tokens is False:
      return self._tok.encode(string)
    return self._tok.encode_with_specials(string)

  def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(sum of log p, all greedy) of each continuation given its context (token ids)."""
    L = self.max_length
    rows = []
    for context, continuation in pairs:
      if not 0 < len(continuation) <= L:
        raise UserError(f"an lm-eval request's continuation has {len(continuation)} tokens; "
                        f"scoring takes 1 to model.max_len={L}")
      whole = (context + continuation)[-(L + 1):]
      rows.append((whole[:-1], whole[1:], len(continuation)))
    out = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    for start in range(0, len(order), self.batch_size):
      chunk = order[start:start + self.batch_size]
      width = _width(len(rows[chunk[0]][0]), L)
      tokens = np.full((self.batch_size, width), self._tok.pad_id, np.int32)
      targets = np.zeros((self.batch_size, width), np.int32)
      segments = np.zeros((self.batch_size, width), np.int32)
      for r, i in enumerate(chunk):
        inputs, outputs, _ = rows[i]
        tokens[r, :len(inputs)], targets[r, :len(inputs)] = inputs, outputs
        segments[r, :len(inputs)] = 1
      logp, greedy = jax.device_get(_token_scores(self._graphdef, self._params, tokens, targets,
                                                  segments))
      for r, i in enumerate(chunk):
        end = len(rows[i][0])
        scored = slice(end - rows[i][2], end)
        out[i] = (float(logp[r, scored].astype(np.float64).sum()), bool(greedy[r, scored].all()))
    return out

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_):
    """TemplateLM's requests ((context, continuation), context ids, continuation ids)."""
    del disable_tqdm
    return self.score([(context, continuation) for _, context, continuation in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Log p of each request's whole text after BOS, in windows of max_len."""
    del disable_tqdm
    from lm_eval import utils  # pylint: disable=import-outside-toplevel
    windows, owners = [], []
    for i, request in enumerate(requests):
      (text,) = request.args
      for window in utils.get_rolling_token_windows(
          token_list=self._tok.encode(text), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1):
        windows.append(utils.make_disjoint_window(window))
        owners.append(i)
    totals = [0.0] * len(requests)
    for i, (logp, _) in zip(owners, self.score(windows)):
      totals[i] += logp
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's generated text, cut before its first stop sequence.

    Requests with the same generation arguments are generated together,
    `batch_size` prompts per call (the last call filled with copies).
    """
    del disable_tqdm
    groups = {}
    for i, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
    out = [None] * len(requests)
    for indices in groups.values():
      until, max_new, sampling = _generation_options(requests[indices[0]].args[1])
      room = self.max_length - max_new
      if room < 1:
        raise UserError(f"an lm-eval task asks for max_gen_toks={max_new} new tokens, which "
                        f"leaves no room for its prompt in model.max_len={self.max_length}")
      prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in indices}
      width = _width(max(len(p) for p in prompts.values()), room)
      for start in range(0, len(indices), self.batch_size):
        chunk = indices[start:start + self.batch_size]
        batch = [prompts[i] for i in chunk] + [prompts[chunk[-1]]] * (self.batch_size - len(chunk))
        new = generate(self._model, self._model_cfg, batch, max_new_tokens=max_new,
                       eos_id=self._tok.eos_id, pad_id=self._tok.pad_id, prompt_width=width,
                       num_tokens=self._tok.vocab_size, **sampling)
        for i, ids in zip(chunk, new):
          out[i] = _cut(self._tok.decode(ids), until)
    return out


def _generation_options(gen_kwargs: dict) -> tuple[list[str], int, dict]:
  """(stop sequences, new tokens, sampling arguments of `generate`) of a task's
  generation arguments (lm-eval's normalisation: aliases of max_gen_toks,
  temperature 0 unless do_sample). An argument our sampler has no use for is
  refused by name."""
  from lm_eval.models.utils import normalize_gen_kwargs  # pylint: disable=import-outside-toplevel
  kwargs = dict(normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS))
  until = [s for s in kwargs.pop("until") if s]
  max_new = kwargs.pop("max_gen_toks")
  do_sample = kwargs.pop("do_sample")
  sampling = {k: kwargs.pop(k) for k in _SAMPLING if k in kwargs}
  if not do_sample:
    sampling = {"temperature": 0.0}
  if kwargs:
    raise UserError(f"an lm-eval task asks for generation arguments {sorted(kwargs)}, which "
                    f"our generation does not take (it takes until, max_gen_toks, do_sample, "
                    f"{', '.join(_SAMPLING)})")
  return until, max_new, sampling


def _cut(text: str, until: list[str]) -> str:
  """`text` up to its first stop sequence."""
  for stop in until:
    text = text.split(stop)[0]
  return text


def harness_model(model, model_cfg, tok, *, batch_size: int, where: str):
  """An lm-eval language model (`lm_eval.api.model.TemplateLM`) over `model`."""
  require_lm_eval(where)
  from lm_eval.api.model import TemplateLM  # pylint: disable=import-outside-toplevel
  return _lm_class(TemplateLM)(model, model_cfg, tok, batch_size=batch_size)


@functools.cache
def _lm_class(template_lm: type) -> type:
  """CheckpointLM as a subclass of lm-eval's TemplateLM (made once)."""
  return type("CheckpointLM", (CheckpointLM, template_lm), {"__doc__": CheckpointLM.__doc__})


def run_tasks(lm, tasks: Tasks, *, limit: int = 0, log_samples: bool = False) -> dict:
  """lm-eval's results (`simple_evaluate`) of `tasks` on `lm`; `limit`: the
  first examples of each task (0: all); `log_samples` keeps every example's
  requests and responses."""
  from lm_eval import evaluator  # pylint: disable=import-outside-toplevel
  return evaluator.simple_evaluate(model=lm, tasks=list(tasks.names), task_manager=tasks.manager,
                                   limit=limit or None, log_samples=log_samples)


def task_report(results: dict, limit: int = 0) -> dict:
  """Per task (and group) of lm-eval's `results`: each metric's value and
  stderr (null where lm-eval has none), the examples scored, the few-shot
  examples, `limit` (null: all) and lm-eval's version."""
  report = {}
  for task, entries in results["results"].items():
    metrics = {}
    for key, value in entries.items():
      metric, _, kind = key.partition(",")
      if not kind or metric.endswith("_stderr") or not isinstance(value, (int, float)):
        continue
      stderr = entries.get(f"{metric}_stderr,{kind}")
      metrics[metric if kind == "none" else key] = {
          "value": float(value),
          "stderr": float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr)
                    else None}
    report[task] = {"metrics": metrics,
                    "samples": results.get("n-samples", {}).get(task, {}).get("effective"),
                    "num_fewshot": results.get("n-shot", {}).get(task),
                    "limit": limit or None, "lm_eval": results.get("lm_eval_version")}
  return report


def evaluate(model, config, tok, tasks: Tasks, *, limit: int, batch_size: int,
             where: str) -> dict:
  """`task_report` of `tasks` run on `model` (a decoder of `config`)."""
  lm = harness_model(model, config.model, tok, batch_size=batch_size, where=where)
  return task_report(run_tasks(lm, tasks, limit=limit), limit)


def scalars(report: dict) -> dict:
  """`downstream/<task>/<metric>`: value of every metric of a `task_report`
  (metrics.jsonl's names)."""
  return {f"downstream/{task}/{name}": metric["value"]
          for task, entry in report.items() for name, metric in entry["metrics"].items()}


def summary(report: dict) -> str:
  """One line: every task's metrics with their stderr."""
  parts = []
  for task, entry in report.items():
    for name, metric in entry["metrics"].items():
      stderr = "" if metric["stderr"] is None else f" ±{metric['stderr']:.3f}"
      parts.append(f"{task}/{name}={metric['value']:.4f}{stderr}")
  return "downstream " + ", ".join(parts)


def plot(path: str, title: str, report: dict, records: list[dict]) -> None:
  """downstream.png: one row per metric (each on its own scale): every task's
  value at this checkpoint (bars with stderr) and, when the run scored tasks
  while training (`records`, metrics.jsonl), their values over steps beside it."""
  # Imported here: the training loop imports this module and need not load matplotlib.
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  bars = {}  # metric -> [(task, value, stderr)]
  for task, entry in report.items():
    for name, metric in entry["metrics"].items():
      bars.setdefault(name, []).append((task, metric["value"], metric["stderr"] or 0.0))
  curves = {}  # metric -> task -> [(step, value)]
  for record in records:
    for key, value in record.items():
      if key.startswith("downstream/"):
        task, name = key.removeprefix("downstream/").split("/", 1)
        curves.setdefault(name, {}).setdefault(task, []).append((record["step"], value))
  rows = sorted(set(bars) | set(curves))
  height = sum(1.4 + 0.3 * len(bars.get(name, ())) for name in rows)
  fig = Figure(figsize=(13 if curves else 7, max(2.5, height)))
  axes = fig.subplots(len(rows), 2 if curves else 1, squeeze=False)
  for row, name in enumerate(rows):
    tasks, values, errors = zip(*bars[name]) if name in bars else ((), (), ())
    ax = axes[row, 0]
    ax.barh(range(len(tasks)), values, xerr=errors, color="tab:blue", alpha=0.8, capsize=3)
    ax.set_yticks(range(len(tasks)), tasks, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"{name} (± stderr), this checkpoint", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    if curves:
      for task, points in sorted(curves.get(name, {}).items()):
        axes[row, 1].plot(*zip(*points), marker=".", label=task)
      axes[row, 1].set_title(f"{name} while training (metrics.jsonl)", fontsize=9)
      axes[row, 1].set_xlabel("step", fontsize=8)
      axes[row, 1].grid(alpha=0.3)
      if name in curves:
        axes[row, 1].legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
