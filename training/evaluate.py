"""Evaluation of a saved run, behind eval.py.

Restores a checkpoint with the run's own config and tokenizer (a different
tokenizer is refused), and writes into `<workdir>/eval/step_<N>/` (or the
`out` directory given) `eval_report.json` with the step, loss, perplexity,
token accuracy and bits per byte over the whole validation split, the
unigram baseline (cross-entropy of the train split's token frequencies on the
same targets: a model must beat it to have learned anything beyond counts),
the run's config history when it has one, samples, and for a mixture of
experts each MoE layer's share of tokens per expert (`expert_report`, plotted
in `expert_load.png`); and two plots:
`loss_curves.png` (the training loss, the in-training validation estimate of
train.eval_steps batches, every whole-split evaluation so far, the unigram
baseline and the learning rate) and `attention_maps.png` (every head of every
layer on the start of the validation split). Evaluating one step never
replaces another's report; `<workdir>/eval_report.json` is a copy of the
newest step's whole-split report, for tools that read one file (a sweep's
"done" test). An evaluation of another data file (`data`), length or RoPE
scaling goes to a folder of its own: `step_<N>_data-<file>`,
`step_<N>_<length>`. With `out` every file goes there and the workdir is
left as it was (no top-level copy, no eval_lengths.json entry).
The pass over the split shows its batches done of the total on stderr
(`training.metrics.Progress`). Every file is written into a temporary folder
beside its destination and moved into place at the end (`Staged`): an
evaluation stopped (SIGINT, SIGTERM: `training/interrupts.py`) or failed
before that leaves the previous outputs as they were and none of its own.

`complete_prompts` (eval.py --prompt without --score) only generates: the
completions of the prompts, in `generations.json`, nothing scored.

With `seq_len` (eval.py --seq_len L) a next_token run is evaluated on rows
of L tokens, any L a learned table holds, and the report adds the loss by
position bucket, `loss_by_position_<label>.png` and an entry in
eval_lengths.json; `rope_scaling` sets RoPE scaling for this evaluation only
(see `training/lengths.py`).

A whole-split report goes to the run's trackers too (`log_to_trackers`,
called by eval.py; training/trackers.py).

Bits per byte = total loss in nats / (ln 2 x UTF-8 bytes of the split): it
does not depend on the tokenizer, so runs with different vocabularies compare.

A data.mixture run is evaluated on each source's whole validation split:
`sources` in the report gives each source's weight, loss, perplexity, token
accuracy, targets and (next_token) bits per byte, bytes and unigram
baseline; the top-level numbers are the mixture's, the sources' weighted by
their weights (`training.metrics.evaluate_mixture`), against the unigram of
the mixture's train token frequencies. loss_curves.png adds each source's
in-training validation curve.

That is the report of a `next_token` run. An `mlm` run (encoder) reports the
masked-token accuracy and loss beside the unigram baseline on the same masked
targets. A `seq2seq` run reports teacher-forced loss and token accuracy, then
generates for the held-out pairs with the KV cache, batched, greedy and with
beam search (length penalty alpha): exact match, BLEU and chrF (sacrebleu),
samples with their references, and for code_summary the
copy-the-function-name baseline; no attention plot for an encoder-decoder.
A `classify` run reports accuracy, macro-F1, per-class precision and
recall and the confusion matrix (`confusion_matrix.png`) beside the
majority-class baseline, and writes every prediction to `predictions.jsonl`
(`training/classify_report.py`); `--data` then classifies the user's file.

With `tasks` (eval.py --tasks) a decoder's report adds `downstream`: each
lm-eval task's metrics with their stderr (`training/downstream.py`,
docs/downstream.md), kept beside those of other tasks evaluated on the same
step before, and `downstream.png`.
"""
import contextlib
import functools
import json
import math
import os
import re
import shutil
import tempfile

import jax
import matplotlib
import numpy as np
import sacrebleu
from flax import nnx

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

from configs import validation  # pylint: disable=wrong-import-position
from configs.errors import UserError  # pylint: disable=wrong-import-position
from data import (classify, mixture, pipeline,  # pylint: disable=wrong-import-position
                  seq2seq, tasks)
from model.generate import (beam_search, generate,  # pylint: disable=wrong-import-position
                            mtp_speculative)
from model.positions import POSITIONS  # pylint: disable=wrong-import-position
from training import (classify_report, compile_cache, downstream,  # pylint: disable=wrong-import-position
                      expert_report, interrupts, lengths, trackers)
from training import workdir as workdir_lib  # pylint: disable=wrong-import-position
from training.metrics import (Progress, evaluate,  # pylint: disable=wrong-import-position
                              evaluate_mixture, read_metrics)
from training.plots import plot_curves, split_curve  # pylint: disable=wrong-import-position
from training.steps import jit_eval_step  # pylint: disable=wrong-import-position

EMBEDDED = ("stdlib", "pydoc", "embedded")


def apply_data_flag(config, data: str) -> None:
  """`--data`: an embedded corpus name (its validation split) or files.

  Files are comma-separated paths or globs; all their documents are
  evaluated. `.jsonl` files are read as JSONL (field data.jsonl_field),
  `.arrayrecord` / `.array_record` as ArrayRecord, `.parquet` as Parquet
  (column data.parquet_column), anything else as text.
  A seq2seq run (any data.task) takes .tsv/.jsonl pair files (data.src_field,
  data.tgt_field), written as its task writes them; a classify run .tsv/.jsonl
  files of texts (labelled or not, data.text_field and data.label_field).
  """
  if config.train.objective == "classify":
    config.data.update(task="labelled", paths=data, val_percent=100)  # every example held out
    return
  if config.train.objective == "seq2seq":
    other = [p for p in data.split(",") if not p.strip().endswith((".tsv", ".jsonl"))]
    if other:
      raise UserError(f"--data {other[0]}: a seq2seq run is scored on pairs; give .tsv (a "
                      f"header row naming {config.data.src_field} and {config.data.tgt_field})"
                      " or .jsonl files, written as the run's task writes its pairs")
    config.data.update(task="pairs", paths=data, val_percent=100)  # every pair is held out
    return
  config.data.mixture = ""  # the given corpus alone
  if data in EMBEDDED:
    config.data.source = data
    return
  first = data.split(",")[0]
  if first.endswith(".jsonl"):
    config.data.source = "jsonl"
  elif first.endswith((".arrayrecord", ".array_record")):
    config.data.source = "arrayrecord"
  elif first.endswith(".parquet"):
    config.data.source = "parquet"
  else:
    config.data.source = "files"
  config.data.paths = data
  config.data.val_percent = 100  # every document is held out


def _token_counts(config, tok, split: str) -> np.ndarray:
  """[V] how often each token occurs in the documents of `split`, read one at a time."""
  index = pipeline.split_index(config, tok, split, quiet=True)
  counts = np.zeros([tok.vocab_size], np.int64)
  for d in range(index.num_documents):
    counts += np.bincount(index.document(d), minlength=tok.vocab_size)
  return counts


def unigram_log_probs(config, tok) -> np.ndarray:
  """Log-probabilities [V] of the add-one-smoothed train split's token
  frequencies; of a data.mixture, its sources' mixed by weight (the
  frequencies of the rows training draws)."""
  mix = mixture.sources(config)
  if not mix:
    counts = _token_counts(config, tok, "train").astype(np.float64) + 1.0
    return np.log(counts / counts.sum())
  probs = sum(source.weight * np.exp(unigram_log_probs(source.config, tok)) for source in mix)
  return np.log(probs / sum(source.weight for source in mix))


def unigram_loss(config, tok, log_probs: np.ndarray | None = None) -> float:
  """Cross-entropy (nats) of the unigram baseline on the validation split of
  `config` (one source): `log_probs`, or its own train split's
  (`unigram_log_probs`)."""
  val_counts = _token_counts(config, tok, "validation")
  if not val_counts.sum():
    return float("nan")
  if log_probs is None:
    log_probs = unigram_log_probs(config, tok)
  return float(-(log_probs * val_counts).sum() / val_counts.sum())


def text_stats(config, tok, metrics: dict, log_probs: np.ndarray | None = None) -> dict:
  """A next_token evaluation of one source's whole validation split: bits
  per byte, the UTF-8 bytes, and the unigram baseline (`unigram_loss`)."""
  stats = pipeline.split_stats(config, tok, "validation")
  return {"bits_per_byte": metrics["loss"] * metrics["targets"] / (stats.num_bytes * math.log(2)),
          "unigram_loss": unigram_loss(config, tok, log_probs), "bytes": stats.num_bytes}


def source_reports(config, tok, by_source: dict[str, dict]) -> dict:
  """A data.mixture's sources in eval_report.json, by name: weight, loss,
  perplexity and token accuracy over the source's whole validation split,
  and for next_token its `text_stats` against the mixture's unigram baseline."""
  log_probs = unigram_log_probs(config, tok) if config.train.objective == "next_token" else None
  out = {}
  for source in mixture.sources(config):
    metrics = by_source[source.name]
    out[source.name] = {"weight": source.weight, "loss": metrics["loss"],
                        "perplexity": metrics["perplexity"],
                        "token_accuracy": metrics["accuracy"], "targets": int(metrics["targets"])}
    if log_probs is not None:
      with mixture.named(source.name):
        out[source.name].update(text_stats(source.config, tok, metrics, log_probs))
  return out


def mixture_text_stats(sources: dict[str, dict]) -> dict:
  """A mixture's bits per byte and unigram baseline: its sources' weighted by
  their weights (as its loss is); its bytes: their sum."""
  total = sum(r["weight"] for r in sources.values())
  return {key: sum(r["weight"] * r[key] for r in sources.values()) / total
          for key in ("bits_per_byte", "unigram_loss")} | {
              "bytes": sum(r["bytes"] for r in sources.values())}


REPORT_FILE = "eval_report.json"
GENERATIONS_FILE = "generations.json"
EVAL_DIR = "eval"
ATTENTION_TOKENS = 40  # tokens of the attention-map input (at least 32)


def full_split_points(workdir: str, extra: dict | None = None) -> tuple[list, list]:
  """(steps, losses) of every whole-split evaluation in `<workdir>/eval/`, with `extra`."""
  points = {}
  root = os.path.join(workdir, EVAL_DIR)
  for name in os.listdir(root) if os.path.isdir(root) else []:
    path = os.path.join(root, name, REPORT_FILE)
    if name.startswith("step_") and os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        report = json.load(f)
      if _whole_split(report) and "loss" in report:
        points[report["step"]] = report["loss"]
  if extra is not None:
    points[extra["step"]] = extra["loss"]
  steps = sorted(points)
  return steps, [points[s] for s in steps]


def plot_loss_curves(workdir: str, path: str, report: dict, eval_steps: int) -> bool:
  """loss_curves.png: train loss, both validation numbers, the unigram baseline and
  the learning rate (second axis); False when the run logged nothing."""
  records = read_metrics(workdir)
  if not records:
    return False
  curves = {"train loss": (*split_curve(records, "train"), {"alpha": 0.8})}
  steps, losses = split_curve(records, "validation")
  if steps:
    curves[f"validation, {eval_steps} batches (in training)"] = (steps, losses, {"marker": "."})
  for name in report.get("sources", {}):
    points = [(r["step"], r[f"loss/{name}"]) for r in records
              if r["split"] == "validation" and f"loss/{name}" in r]
    if points:
      curves[f"validation of {name} (in training)"] = (*zip(*points), {"linestyle": ":"})
  full = full_split_points(workdir, None if report.get("data_override") else report)
  if full[0]:
    curves["validation, whole split (eval.py)"] = (*full, {"marker": "D", "linestyle": "--"})
  train = [r for r in records if r["split"] == "train" and "learning_rate" in r]
  plot_curves(path, f"{os.path.basename(os.path.abspath(workdir))}: loss", curves,
              baseline=report.get("unigram_loss"),
              learning_rate=([r["step"] for r in train], [r["learning_rate"] for r in train]))
  return True


def attention_ids(config, tok, prompt_ids: list[int] | None = None) -> list[int]:
  """The attention-map input: `prompt_ids` (a seq2seq row's prompt), else the
  first ATTENTION_TOKENS tokens of the validation split."""
  if prompt_ids is not None:
    return list(prompt_ids)[:config.train.seq_len]
  mix = mixture.sources(config)
  index = pipeline.split_index(mix[0].config if mix else config, tok, "validation", quiet=True)
  ids = [tok.bos_id]
  for d in range(index.num_documents):
    ids += [int(i) for i in index.document(d)[:ATTENTION_TOKENS - len(ids)]]
    if len(ids) >= ATTENTION_TOKENS:
      break
  return ids


@functools.partial(jax.jit, static_argnames=("graphdef", "causal"))
def _stack_attention_maps(graphdef, state, tokens_BT, causal: bool):
  """`_Stack.attention_maps` of the stack (`graphdef`, `state`) as one
  compiled call: run op by op, a fresh process compiles every op on its
  first use, which cost a plot seconds on CPU (CHANGELOG, 2026-12-06)."""
  return nnx.merge(graphdef, state).attention_maps(tokens_BT, causal=causal)


def attention_maps(model, config, ids: list[int]) -> list[np.ndarray]:
  """Every layer's self-attention weights [h, T, T] on `ids`: the decoder's
  (causal) for a decoder, else the encoder's."""
  stack = model.encoder if config.model.family != "decoder" else model.decoder
  graphdef, state = nnx.split(stack)
  maps = _stack_attention_maps(graphdef, state, np.asarray([ids]),
                               causal=config.model.family == "decoder")
  return [np.asarray(m)[0] for m in maps]


def plot_attention(model, config, tok, ids: list[int], path: str) -> None:
  """A grid of every layer (rows) and head (columns), tokens on the axes, one colour bar."""
  weights = attention_maps(model, config, ids)
  layers, heads = len(weights), weights[0].shape[0]
  labels = ["<bos>" if i == tok.bos_id else repr(tok.decode([i]))[1:-1][:8] for i in ids]
  side = max(3.0, 0.11 * len(ids))
  fig, axes = plt.subplots(layers, heads, figsize=(side * heads + 1.2, side * layers + 0.8),
                           squeeze=False, constrained_layout=True)
  image = None
  for layer in range(layers):
    for h in range(heads):
      ax = axes[layer, h]
      image = ax.imshow(weights[layer][h], cmap="viridis", vmin=0.0, vmax=1.0)
      ax.set_title(f"layer {layer}, head {h}", fontsize=9)
      ax.set_xticks(range(len(ids)), labels, rotation=90, fontsize=6)
      ax.set_yticks(range(len(ids)), labels, fontsize=6)
      if h:
        ax.set_yticklabels([])
    axes[layer, 0].set_ylabel("query token", fontsize=8)
  for h in range(heads):
    axes[-1, h].set_xlabel("key token", fontsize=8)
  fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
  fig.suptitle(f"attention of every layer and head on {len(ids)} validation tokens")
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _whole_split(report: dict) -> bool:
  """Whether `report` is of the run's own validation split at its training
  length and RoPE scaling (no --data, --seq_len or --rope_scaling)."""
  return (report.get("data_override") is None and "rope_override" not in report
          and report.get("seq_len") == report.get("train_seq_len"))


def _out_dir(workdir: str, step: int, data: str | None, length: str | None = None) -> str:
  """`<workdir>/eval/step_<N>`, with a suffix for another length or RoPE
  scaling (`length`) or another data file (`data`): a folder of its own each,
  so that no evaluation overwrites another's report."""
  name = f"step_{step}" + (f"_{length}" if length else "")
  if data:
    name += "_data-" + re.sub(r"[^\w.-]+", "_", os.path.basename(data.rstrip("/")) or "data")
  return os.path.join(workdir, EVAL_DIR, name)


class Staged:
  """An evaluation's outputs, written into a temporary folder beside their
  destination and moved into place by `commit` only: a stopped or failed
  evaluation leaves nothing of its own, and the outputs it would replace as
  they were. A context manager: leaving it uncommitted removes what it staged.

  `folder` is where the files go; they are written into `staging`
  (`path(name)`). The workdir's own folder (`workdir` given,
  `eval/step_<N>...`) is replaced whole by a rename, the files of the one it
  replaces that this evaluation does not write (generations.json beside a
  report) carried over; eval.py --out's folder (`workdir` None) is made by a
  rename when it does not exist, else each file is renamed into it (it may
  hold other things). The workdir's top-level files (`top_path`, `later`)
  follow the folder, the report's copy last. The moves are one
  `interrupts.held` block, which SIGINT and SIGTERM do not cut; before it
  they remove the temporary folder (and any folder made to hold it), and
  eval.py's line says `what` was stopped (`evaluating step 40`).
  """

  def __init__(self, folder: str, workdir: str | None, what: str):
    if os.path.exists(folder) and not os.path.isdir(folder):
      raise UserError(f"{folder} is a file, and eval.py writes a folder there; give --out a "
                      "directory, or move the file")
    self.folder, self.workdir = folder, workdir
    self._merge = workdir is None and os.path.isdir(folder)
    parent = folder if self._merge else os.path.dirname(os.path.abspath(folder))
    self._made = []  # the folders made to hold the temporary one, deepest first
    missing = parent
    while not os.path.exists(missing):
      self._made.append(missing)
      missing = os.path.dirname(missing)
    kept = workdir if workdir is not None else folder
    stopped = f"nothing written ({kept} {'as it was' if os.path.isdir(kept) else 'not made'})"
    with interrupts.held():
      os.makedirs(parent, exist_ok=True)
      prefix = ".eval" if self._merge else "." + os.path.basename(os.path.abspath(folder))
      self._root = tempfile.mkdtemp(prefix=prefix + ".tmp-", dir=parent)
      self.staging = os.path.join(self._root, "out")
      os.mkdir(self.staging)
      interrupts.on_signal(lambda name: f"{name} while {what}: stopped, {stopped}; run the same "
                           f"command again: {interrupts.command()}", self.discard)
    self._tops = {}  # staged path -> the workdir's top-level path
    self._later = []  # writes into the workdir's top level, in order
    self._committed = False

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if not self._committed:
      self.discard()

  def path(self, name: str) -> str:
    """The staged path of `name` in the folder."""
    return os.path.join(self.staging, name)

  def top_path(self, name: str) -> str:
    """The staged path of `name` in the workdir's top level."""
    staged = os.path.join(self._root, name)
    self._tops[staged] = os.path.join(self.workdir, name)
    return staged

  def later(self, write) -> None:
    """`write()` (a file of the workdir's top level, written atomically) at the commit."""
    self._later.append(write)

  def final(self, path: str) -> str:
    """Where a staged path will be (others: as they are)."""
    if path in self._tops:
      return self._tops[path]
    if path.startswith(self.staging + os.sep):
      return os.path.join(self.folder, os.path.relpath(path, self.staging))
    return path

  def commit(self, paths: list[str]) -> list[str]:
    """Moves everything into place; returns `paths` where they now are."""
    with interrupts.held():
      if not os.path.isdir(self.folder):
        os.rename(self.staging, self.folder)
      elif self._merge:
        for name in os.listdir(self.staging):
          os.replace(os.path.join(self.staging, name), os.path.join(self.folder, name))
      else:
        for name in os.listdir(self.folder):
          carried = os.path.join(self.staging, name)
          if not os.path.lexists(carried):
            _copy(os.path.join(self.folder, name), carried)
        replaced = os.path.join(self._root, "replaced")
        os.rename(self.folder, replaced)
        try:
          os.rename(self.staging, self.folder)
        except OSError:
          os.rename(replaced, self.folder)  # not removed with the rest
          raise
      for staged, top in self._tops.items():
        os.replace(staged, top)
      for write in self._later:
        write()
      shutil.rmtree(self._root)
      self._committed = True
      interrupts.on_signal(lambda name: f"{name} after writing {self.folder} (complete, kept): "
                           "stopped before eval.py's end; run the same command again to redo it: "
                           f"{interrupts.command()}")
    return [self.final(p) for p in paths]

  def discard(self) -> None:
    """Removes what was staged, and the folders made to hold it; never raises
    (a signal handler calls it)."""
    shutil.rmtree(self._root, ignore_errors=True)
    for made in self._made:
      with contextlib.suppress(OSError):
        os.rmdir(made)


def _copy(source: str, target: str) -> None:
  """A file, link or folder copied as it is."""
  if os.path.isdir(source) and not os.path.islink(source):
    shutil.copytree(source, target, symlinks=True)
  else:
    shutil.copy2(source, target, follow_symlinks=False)


def _write_report(report: dict, staged: Staged) -> list[str]:
  """Writes the report into the staged folder and, into the workdir's own
  one, also the workdir's top-level copy when it is the newest whole-split
  evaluation (at the commit, last). Returns the paths written (staged)."""
  paths = [staged.path(REPORT_FILE)]
  workdir_lib.write_json_atomic(paths[0], report)
  if staged.workdir is None or not _whole_split(report):
    return paths
  top = os.path.join(staged.workdir, REPORT_FILE)
  try:
    with open(top, encoding="utf-8") as f:
      newest = json.load(f).get("step", -1)
  except (FileNotFoundError, json.JSONDecodeError):
    newest = -1
  if report["step"] >= newest:
    staged.later(functools.partial(workdir_lib.write_json_atomic, top, dict(report)))
    paths.append(top)
  return paths


NOT_METRICS = ("step", "seq_len", "train_seq_len")  # numbers of a report that describe it


def log_to_trackers(workdir: str, report: dict) -> None:
  """A whole-split report (`_whole_split`) to the run's trackers, continuing
  their runs (training/trackers.py): its numbers as `eval/<name>` at its step,
  each file it wrote as `eval/<file name>`. Other evaluations (data, length,
  RoPE scaling) stay in the workdir; eval.py does not call it for an
  evaluation written elsewhere (--out)."""
  if not _whole_split(report):
    return
  numbers = {f"eval/{k}": float(v) for k, v in report.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS}
  files = {}
  for path in report["files"]:  # the report's own folder first, then the workdir's copy
    files.setdefault(os.path.basename(path), path)
  opened = trackers.open_saved_run(workdir)
  try:
    for tracker in opened:
      tracker.log_metrics(report["step"], numbers)
      for name, path in files.items():
        tracker.log_file(path, f"eval/{name}", report["step"])
  finally:
    for tracker in opened:
      tracker.close()


def run_eval(workdir: str, *, step: int | None = None, data: str | None = None,
             tokenizer_path: str | None = None, prompts: list[str] | None = None,
             max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, beam_size: int = 4, alpha: float = 0.6,
             max_examples: int = 0, out: str | None = None, seq_len: int | None = None,
             rope_scaling: str | None = None, rope_scaling_factor: float | None = None,
             position_buckets: int = 16, tasks: str | None = None, task_dir: str = "",
             task_limit: int = 0, task_batch_size: int = 32, draft: str | None = None) -> dict:
  """Evaluates a checkpoint; writes the report and plots into `out` (default
  `<workdir>/eval/step_<N>/`; given, nothing in the workdir changes), see the
  module docstring. `prompts` (a next_token run's; default three) are
  completed into the report's samples.

  `beam_size`, `alpha` (length penalty) and `max_examples` (0: all) apply to
  seq2seq runs. `seq_len` evaluates on rows of that many tokens and reports
  the loss in `position_buckets` buckets of position; `rope_scaling` and
  `rope_scaling_factor` override the run's RoPE scaling for this evaluation.
  `tasks` (comma-separated lm-eval task names, with the YAMLs of `task_dir`)
  adds their metrics under `downstream` (`training/downstream.py`): the
  first `task_limit` examples of each (0: all), `task_batch_size` rows per
  forward pass. `draft` ("mtp" or None) as in `complete_prompts`.
  """
  saved = workdir_lib.load_config(workdir)
  if prompts:
    _check_completes(saved)
  _check_draft(saved, draft, temperature)
  compile_cache.enable(saved.train.compilation_cache_dir)
  task_set = _downstream_tasks(saved, tasks, task_dir, task_limit, task_batch_size)
  config, tok, model, step = workdir_lib.load_run(workdir, step, tokenizer_path)
  if data:
    apply_data_flag(config, data)
  if config.train.objective == "classify":
    with Staged(out or _out_dir(workdir, step, data), None if out else workdir,
                f"evaluating step {step}") as staged:
      return _classify_eval(workdir, config, tok, model, step, data, staged)
  train_len = config.train.seq_len
  rope_override = None
  if rope_scaling is not None:
    rope_override = lengths.apply_rope_scaling(config, rope_scaling, rope_scaling_factor)
    model = lengths.with_model_config(model, config.model)
  if seq_len is not None:
    lengths.apply_seq_len(config, seq_len)
  if position_buckets < 1:
    raise UserError(f"--position_buckets {position_buckets}: must be a positive integer")
  folder = out
  if folder is None:
    other = seq_len is not None and seq_len != train_len or rope_override
    folder = _out_dir(workdir, step, data,
                      lengths.label(seq_len or train_len, rope_override) if other else None)
  with Staged(folder, None if out else workdir, f"evaluating step {step}") as staged:
    graphdef, params = nnx.split(model)
    eval_fn = jit_eval_step(graphdef, config.train.objective, mtp_depth=config.train.mtp_depth,
                            loss_chunk_size=config.train.loss_chunk_size,
                            loss_impl=config.train.loss_impl)
    mix = mixture.sources(config)
    if mix:
      source_batches = pipeline.make_source_eval_batches(config, tok, None)
      batches = [batch for name in source_batches for batch in source_batches[name]]
      with Progress(len(batches)) as progress:
        metrics, by_source = evaluate_mixture(eval_fn, params, source_batches,
                                              {source.name: source.weight for source in mix},
                                              progress)
    else:
      batches = pipeline.make_eval_batches(config, tok, None)
      with Progress(len(batches)) as progress:
        metrics = evaluate(eval_fn, params, batches, progress)
    report = {"step": step, "data": config.data.mixture or config.data.source,
              "data_override": data, "split": "validation, whole split", "loss": metrics["loss"],
              "perplexity": metrics["perplexity"], "token_accuracy": metrics["accuracy"],
              "targets": int(metrics["targets"]), "seq_len": config.train.seq_len,
              "train_seq_len": train_len,
              **{name: value for name, value in metrics.items() if name.startswith("mtp")}}
    if rope_override:
      report["rope_override"] = rope_override
    if mix:
      report["sources"] = source_reports(config, tok, by_source)
    history = workdir_lib.read_history(workdir)
    if history:
      report["config_history"] = workdir_lib.history_lines(history)
    length_files = []
    if seq_len is not None:
      name = lengths.label(seq_len, rope_override)
      report["loss_by_position"] = lengths.loss_by_position(
          graphdef, params, batches, seq_len=seq_len, num_buckets=position_buckets)
      png_name = f"loss_by_position_{name}.png"
      png = staged.path(png_name) if out is not None else staged.top_path(png_name)
      lengths.plot_loss_by_position(
          png, report["loss_by_position"], train_len=train_len,
          title=f"{os.path.basename(os.path.abspath(workdir))} at step {step}, rows of {seq_len}"
                + (f", rope_scaling {rope_scaling} x{rope_scaling_factor:g}" if rope_override
                   else ""))
      length_files.append(png)
      if out is None:
        entry = {"seq_len": seq_len, "step": step, "loss": metrics["loss"],
                 "rope_override": rope_override, "loss_by_position": report["loss_by_position"]}
        staged.later(functools.partial(lengths.record, workdir, name, entry))
        length_files.append(os.path.join(workdir, lengths.LENGTHS_FILE))
    if config.model.num_experts:
      report.update(expert_report.expert_load(config, graphdef, params, batches))
    attention_prompt = None
    if config.train.objective == "next_token":
      report.update(mixture_text_stats(report["sources"]) if mix
                    else text_stats(config, tok, metrics))
      report["samples"], speculative = _complete(
          model, config, tok, prompts or ["def ", "class ", "import "],
          max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
          draft=draft)
      if speculative is not None:
        report["speculative"] = speculative
    elif config.train.objective == "mlm":
      report.update(masked_lm_report(config, tok, batches, metrics))
    else:
      rows = seq2seq.load_rows(config, tok, "validation")
      report["data"] = f"task={config.data.task}"
      report.update(seq2seq_report(model, config, tok, rows, beam_size=beam_size, alpha=alpha,
                                   max_examples=max_examples, task=saved.data.task))
      attention_prompt = rows.prompt(0)
    downstream_png = _add_downstream(report, model, config, tok, task_set, staged, workdir,
                                      limit=task_limit, batch_size=task_batch_size)
    files = _write_report(report, staged) + length_files + downstream_png
    loss_png = staged.path("loss_curves.png")
    if plot_loss_curves(workdir, loss_png, report, config.train.eval_steps):
      files.append(loss_png)
    if config.model.num_experts:
      load_png = staged.path("expert_load.png")
      name = os.path.basename(os.path.abspath(workdir))
      expert_report.plot_expert_load(load_png, report,
                                     f"{name} at step {step}: tokens per expert, validation")
      files.append(load_png)
    attn_png = staged.path("attention_maps.png")
    if config.model.family != "encoder_decoder":
      plot_attention(model, config, tok, attention_ids(config, tok, attention_prompt), attn_png)
      files.append(attn_png)
    report["files"] = staged.commit(files)
    return report


def _check_completes(config) -> None:
  """Prompts are completed by next_token runs only: a UserError for another
  objective, whose evaluation scores what it was trained for."""
  objective = config.train.objective
  if objective != "next_token":
    raise UserError(f"--prompt: a {objective} run does not complete prompts (a next_token run "
                    "does); evaluate it without --prompt")


def _check_draft(config, draft: str | None, temperature: float) -> None:
  """--draft mtp against the run, before its checkpoint is read: a UserError
  for a run without MTP modules or a sampling temperature (the drafts are
  verified greedily)."""
  if draft is None:
    return
  if not config.train.mtp_depth:
    raise UserError("--draft mtp drafts with the multi-token prediction modules, and this run "
                    "was trained without them (train.mtp_depth=0); drop --draft")
  if temperature > 0:
    raise UserError(f"--draft mtp verifies the drafts greedily, and --temperature {temperature} "
                    "samples; drop --temperature or --draft")


def _complete(model, config, tok, prompts: list[str], *, max_new_tokens: int,
              temperature: float, top_k: int, top_p: float, draft: str | None = None):
  """([{"prompt", "completion"}] of `prompts`, generated with the KV cache
  after BOS; with `draft="mtp"` self-speculatively, and then its passes and
  acceptance, else None)."""
  encoded = [[tok.bos_id] + tok.encode(p) for p in prompts]
  common = dict(max_new_tokens=max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
                num_tokens=tok.vocab_size)
  speculative = None
  if draft is None:
    outs = generate(model, config.model, encoded, temperature=temperature, top_k=top_k,
                    top_p=top_p, **common)
  else:
    outs, speculative = mtp_speculative(model, config.model, encoded, **common)
  return [{"prompt": p, "completion": tok.decode(o)} for p, o in zip(prompts, outs)], speculative


def complete_prompts(workdir: str, prompts: list[str], *, step: int | None = None,
                     tokenizer_path: str | None = None, max_new_tokens: int = 64,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     out: str | None = None, draft: str | None = None) -> dict:
  """Completions of `prompts` by a next_token run's checkpoint, nothing
  scored (no data read): {"step", "max_new_tokens", "temperature", "top_k",
  "top_p", "samples" [{"prompt", "completion"}], "files"}, written without
  "files" to `<out>/generations.json` (default `<workdir>/eval/step_<N>/`,
  beside that step's report, which it leaves alone). `draft="mtp"`: greedy
  decoding drafted by the run's multi-token prediction modules
  (`model.generate.mtp_speculative`; the same tokens), its passes and
  acceptance under "speculative"."""
  saved = workdir_lib.load_config(workdir)
  _check_completes(saved)
  _check_draft(saved, draft, temperature)
  compile_cache.enable(saved.train.compilation_cache_dir)
  config, tok, model, step = workdir_lib.load_run(workdir, step, tokenizer_path)
  folder = out or _out_dir(workdir, step, None)
  with Staged(folder, None if out else workdir, f"completing prompts at step {step}") as staged:
    samples, speculative = _complete(model, config, tok, prompts, max_new_tokens=max_new_tokens,
                                     temperature=temperature, top_k=top_k, top_p=top_p,
                                     draft=draft)
    result = {"step": step, "max_new_tokens": max_new_tokens, "temperature": temperature,
              "top_k": top_k, "top_p": top_p, "samples": samples,
              **({"speculative": speculative} if speculative is not None else {})}
    path = staged.path(GENERATIONS_FILE)
    workdir_lib.write_json_atomic(path, result)
    return {**result, "files": staged.commit([path])}


def _downstream_tasks(config, tasks: str | None, task_dir: str, limit: int,
                      batch_size: int) -> downstream.Tasks | None:
  """eval.py's lm-eval flags checked against the run's `config`: the tasks
  to run (None without --tasks)."""
  if not tasks:
    if task_dir:
      raise UserError(f"--task_dir {task_dir}: adds task YAMLs for --tasks, which is not "
                      "given; name the tasks to run with --tasks")
    return None
  validation.check_downstream_model(config.model, "--tasks", tasks)
  if limit < 0:
    raise UserError(f"--task_limit {limit}: must be 0 (every example) or a positive integer")
  if batch_size < 1:
    raise UserError(f"--task_batch_size {batch_size}: must be a positive integer")
  return downstream.load_tasks(tasks, task_dir, field="--tasks", dir_field="--task_dir")


def _add_downstream(report: dict, model, config, tok, task_set, staged: Staged, workdir: str, *,
                    limit: int, batch_size: int) -> list[str]:
  """Runs `task_set` (None: none) into `report["downstream"]`, beside the
  results of other tasks already in the report of this step that `staged`
  replaces; plots them in downstream.png. Returns the plot's path (staged),
  if any."""
  try:
    with open(os.path.join(staged.folder, REPORT_FILE), encoding="utf-8") as f:
      previous = json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    previous = {}
  results = previous.get("downstream", {}) if previous.get("step") == report["step"] else {}
  if task_set is not None:
    results.update(downstream.evaluate(model, config, tok, task_set, limit=limit,
                                       batch_size=batch_size, where="--tasks"))
  if not results:
    return []
  report["downstream"] = results
  png = staged.path("downstream.png")
  name = os.path.basename(os.path.abspath(workdir))
  downstream.plot(png, f"{name} at step {report['step']}: lm-eval tasks", results,
                  read_metrics(workdir))
  return [png]


def _classify_eval(workdir: str, config, tok, model, step: int, data: str | None,
                   staged: Staged) -> dict:
  """A classify run's report (`training/classify_report.py`) and plots,
  staged and committed; into the workdir's own folder also its top-level
  eval_report.json, as for a language model."""
  rows = classify.load_rows(config, tok, "validation")
  where = (config.data.paths if config.data.val_percent == 100
           else f"task={config.data.task} validation")
  report, files = classify_report.classify_report(
      model, rows, staged.staging, os.path.basename(os.path.abspath(workdir)))
  report = {"step": step, "data": where, "data_override": data, **report}
  files = _write_report(report, staged) + files
  loss_png = staged.path("loss_curves.png")
  if plot_loss_curves(workdir, loss_png, report, config.train.eval_steps):
    files.append(loss_png)
  report["files"] = staged.commit(files)
  return report


def masked_lm_report(config, tok, batches, metrics) -> dict:
  """Masked-token accuracy against the unigram baseline on the same masked targets.

  The baseline predicts the most frequent train token at every masked
  position (its accuracy) and the add-one-smoothed train token frequencies
  (its cross-entropy).
  """
  logp = unigram_log_probs(config, tok)
  targets = np.concatenate([np.asarray(b["targets"])[np.asarray(b["loss_mask"]) > 0]
                            for b in batches])
  return {"masked_token_accuracy": metrics["accuracy"], "masked_tokens": int(len(targets)),
          "unigram_accuracy": float(np.mean(targets == np.argmax(logp))),
          "unigram_loss": float(-logp[targets].mean())}


_GENERATION_BATCH = 64  # prompts per generation call (beam search: times the beam size)


def predict(model, config, tok, rows, count: int, *, beam_size: int, alpha: float) -> list[str]:
  """Texts generated for the first `count` pairs of `rows`: greedy (beam 1) or beam search.

  Every call has the same shapes (the last batch is filled with copies of its
  last prompt), so one compiled function serves them all. The budget of new
  tokens is the longest target (with EOS) that the rows could hold.
  """
  t = config.train
  prompts = [rows.prompt(i) for i in range(count)]
  sources = [rows.src_ids[i].tolist() for i in range(count)]
  prompt_width = max(len(p) for p in prompts)
  if config.model.family == "decoder":
    budget = t.seq_len + 1 - min(len(p) for p in prompts)
    kwargs = {}
  else:
    budget = t.tgt_seq_len or t.seq_len
    kwargs = {"source_width": max(max(len(s) for s in sources), 1)}
  if POSITIONS[config.model.pos_emb].bounded:
    budget = min(budget, config.model.max_len - prompt_width)
  outs = []
  for start in range(0, count, _GENERATION_BATCH):
    batch = list(range(start, min(start + _GENERATION_BATCH, count)))
    batch += [batch[-1]] * (_GENERATION_BATCH - len(batch))
    if config.model.family == "encoder_decoder":
      kwargs["sources"] = [sources[i] for i in batch]
    new = beam_search(model, config.model, [prompts[i] for i in batch], beam_size=beam_size,
                      alpha=alpha, max_new_tokens=budget, eos_id=tok.eos_id, pad_id=tok.pad_id,
                      prompt_width=prompt_width, num_tokens=tok.vocab_size, **kwargs)
    outs.extend(new[:min(_GENERATION_BATCH, count - start)])
  return [tok.decode(o) for o in outs]


def text_scores(predictions: list[str], references: list[str], *,
                bleu_tokenize: str = "13a") -> dict:
  """Exact match (fraction), corpus BLEU and chrF (sacrebleu, 0-100).

  BLEU splits words with sacrebleu's `13a` tokenizer; the synthetic tasks'
  answers are single words, so they use `char` (BLEU over characters).
  """
  bleu = sacrebleu.corpus_bleu(predictions, [references], tokenize=bleu_tokenize)
  return {"exact_match": float(np.mean([p == r for p, r in zip(predictions, references)])),
          "bleu": bleu.score, "chrf": sacrebleu.corpus_chrf(predictions, [references]).score}


def seq2seq_report(model, config, tok, rows, *, beam_size: int, alpha: float,
                   max_examples: int = 0, num_samples: int = 10, task: str = "") -> dict:
  """Greedy and beam-search scores on the validation pairs, with samples.

  BLEU counts characters for a run trained on a synthetic task (`task`, the
  run's data.task; default config's: its answers are one word), else words.
  For code_summary also the copy-the-function-name baseline (the name split
  on underscores) on the same pairs.
  """
  count = rows.num_pairs if not max_examples else min(max_examples, rows.num_pairs)
  references = rows.tgt_texts[:count]
  tokenize = "char" if (task or config.data.task) in tasks.SYNTHETIC_TASKS else "13a"
  greedy = predict(model, config, tok, rows, count, beam_size=1, alpha=alpha)
  beam = predict(model, config, tok, rows, count, beam_size=beam_size, alpha=alpha)
  report = {"examples": count, "bleu_tokenize": tokenize,
            "greedy": text_scores(greedy, references, bleu_tokenize=tokenize),
            "beam": {"beam_size": beam_size, "alpha": alpha,
                     **text_scores(beam, references, bleu_tokenize=tokenize)}}
  if config.data.task == "code_summary":
    report["name_baseline"] = text_scores(
        [tasks.name_baseline(src) for src in rows.src_texts[:count]], references)
  report["samples"] = [
      {"source": rows.src_texts[i], "reference": references[i], "greedy": greedy[i],
       "beam": beam[i]} for i in range(min(num_samples, count))]
  return report
