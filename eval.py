"""Evaluate a run: python eval.py --workdir runs/tiny [--step N] [--data ...]
[--prompt TEXT --max_new_tokens N [--draft mtp] [--score]]
[--beam_size K --length_penalty A --max_examples N]
[--seq_len L [--position_buckets N]] [--rope_scaling yarn --rope_scaling_factor 4]
[--tasks hellaswag,arc_easy [--task_dir DIR] [--task_limit N] [--task_batch_size B]] [--out DIR]

Restores the checkpoint with its own config and tokenizer, scores the whole
validation split (batches done of the total on stderr: a bar on a terminal,
else a line at every tenth), writes eval_report.json, loss_curves.png and
attention_maps.png into <workdir>/eval/step_<N>/; <workdir>/eval_report.json
is a copy of the newest step's whole-split report. With --out DIR everything
goes to DIR and the workdir is left as it was (nor are the trackers sent it).
`--prompt TEXT` (repeatable) alone only completes the prompts: it prints the
completions and writes them to generations.json in that folder, scores
nothing and leaves eval_report.json alone; `--prompt ... --score` scores as
well, the completions being the report's samples (next_token runs).
`--draft mtp` completes them greedily drafted by the run's multi-token
prediction modules (train.mtp_depth) and verified by the main model: the
same tokens in fewer passes of it; it prints the acceptance of the drafts
and writes it under "speculative" (docs/evaluation.md).
Seq2seq runs are scored by generation (greedy and beam search), masked-LM
runs by masked-token accuracy, classify runs by accuracy, macro-F1 and a
confusion matrix (confusion_matrix.png, predictions.jsonl; --data classifies
a .tsv/.jsonl file); each beside its baseline. `--seq_len L`
evaluates a next_token run on rows of L tokens and reports the loss by
position (a table, loss_by_position_<L>.png); `--rope_scaling` stretches a
RoPE run's context for this evaluation only. Both are in eval_report.json.
`--tasks` runs lm-evaluation-harness tasks (lm-eval's, or your YAMLs in
--task_dir) on a decoder: their metrics go under `downstream` in
eval_report.json and into downstream.png (docs/downstream.md).
A whole-split report also goes to the run's trackers (train.trackers,
docs/tracking.md), into the tracker runs its training used.

The files are written into a temporary folder beside their destination and
moved into place once all are written (the workdir's eval_report.json copy
last): a stopped or failed evaluation leaves the previous outputs as they
were and none of its own.

Exit status: 0, evaluated (or completed) and written; 130 or 143 (128 + the
signal), stopped by SIGINT or SIGTERM, with one line saying what was
stopped, what is kept and the command to run again (once the files are
moved into place, they are kept whole); 2, a user error (one line on
stderr); 1, a bug (a traceback).
"""
import json
import os
import sys

from absl import app, flags, logging

from configs.cli import parse_flags
from configs.errors import UserError
from training import interrupts

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory to evaluate.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_DATA = flags.DEFINE_string("data", None, "stdlib | pydoc | embedded, or files/globs "
                            "(comma-separated; .jsonl and .arrayrecord by extension); "
                            "classify runs: .tsv/.jsonl texts to classify; seq2seq "
                            "runs: .tsv/.jsonl pairs to score.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "A tokenizer to use instead of the "
                                 "run's (refused unless it is the same one).")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "Prompt(s) to complete (next_token runs); "
                                    "alone, nothing is scored: add --score for the report.")
_SCORE = flags.DEFINE_bool("score", False, "With --prompt: also score the whole validation "
                           "split (eval_report.json and the plots, as without --prompt).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_DRAFT = flags.DEFINE_enum("draft", None, ["mtp"], "With --prompt: greedy decoding drafted by "
                           "the run's multi-token prediction modules (train.mtp_depth), verified "
                           "by the main model (the same tokens, fewer passes).")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", 4, "seq2seq: beams of the beam search.")
_ALPHA = flags.DEFINE_float("length_penalty", 0.6, "seq2seq: beam scores are log p / "
                            "((5 + length) / 6)^alpha; 0: none.")
_MAX_EXAMPLES = flags.DEFINE_integer("max_examples", 0, "seq2seq: held-out pairs to "
                                     "generate for (0: all).")
_OUT = flags.DEFINE_string("out", None, "Directory for the report and plots (default: "
                           "<workdir>/eval/step_<N>).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "next_token: evaluate on rows of this many "
                                "tokens and report the loss by position (default: the "
                                "training length, no position table).")
_BUCKETS = flags.DEFINE_integer("position_buckets", 16, "--seq_len: buckets of position.")
_ROPE_SCALING = flags.DEFINE_enum("rope_scaling", None, ["none", "linear", "ntk", "yarn",
                                                         "llama3"],
                                  "RoPE scaling for this evaluation only (a rope run).")
_ROPE_FACTOR = flags.DEFINE_float("rope_scaling_factor", None, "--rope_scaling: context "
                                  "stretch over the training length.")
_TASKS = flags.DEFINE_string("tasks", None, "lm-eval tasks to run, comma-separated "
                             "(hellaswag,arc_easy; needs lm-eval).")
_TASK_DIR = flags.DEFINE_string("task_dir", "", "--tasks: a directory of your own lm-eval "
                                "task YAMLs.")
_TASK_LIMIT = flags.DEFINE_integer("task_limit", 0, "--tasks: the first N examples of each "
                                   "task (0: all).")
_TASK_BATCH = flags.DEFINE_integer("task_batch_size", 32, "--tasks: rows per forward pass "
                                   "(prompts per generation call).")
flags.mark_flag_as_required("workdir")

# Flags of a scoring: refused with --prompt alone, which scores nothing.
SCORING_FLAGS = ("data", "seq_len", "position_buckets", "rope_scaling", "rope_scaling_factor",
                 "beam_size", "length_penalty", "max_examples", "tasks", "task_dir",
                 "task_limit", "task_batch_size")


def complete(evaluate) -> None:
  """--prompt without --score: the completions, printed and in generations.json."""
  given = [name for name in SCORING_FLAGS if flags.FLAGS[name].present]
  if given:
    raise UserError(f"--{given[0]} is for scoring, and --prompt alone only completes the "
                    f"prompts; add --score to score as well, or drop --{given[0]}")
  result = evaluate.complete_prompts(
      _WORKDIR.value, _PROMPT.value, step=_STEP.value, tokenizer_path=_TOKENIZER.value,
      max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
      top_p=_TOP_P.value, out=_OUT.value, draft=_DRAFT.value)
  interrupts.exit_quietly(0)  # written: what is left is printing it
  for sample in result["samples"]:
    print(f"--- step {result['step']}, prompt {sample['prompt']!r}:")
    print(sample["prompt"] + sample["completion"])
  if "speculative" in result:
    print(speculative_line(result["speculative"]))
  print("wrote " + ", ".join(result["files"]))


def speculative_line(stats: dict) -> str:
  """--draft mtp's acceptance, one line."""
  return (f"draft mtp (depth {stats['draft_depth']}): {stats['accepted']} of "
          f"{stats['drafted']} drafted tokens accepted ({stats['acceptance_rate']:.1%}), "
          f"{stats['tokens_per_pass']:.2f} tokens per pass of the main model")


def main(argv):
  if len(argv) > 1:
    print(f"error: unexpected arguments: {' '.join(argv[1:])} (eval.py takes --workdir and "
          "its other flags only; --help lists them)", file=sys.stderr)
    sys.exit(2)
  logging.set_verbosity(logging.WARNING)
  sys.exit(_eval())


def _eval() -> int:
  """Evaluates (or completes the prompts) and prints the result; the exit status."""
  from training import evaluate  # pylint: disable=import-outside-toplevel
  try:
    if _DRAFT.value and not _PROMPT.value:
      raise UserError("--draft drafts the completions of --prompt, and no --prompt is given; "
                      "add --prompt TEXT or drop --draft")
    if _PROMPT.value and not _SCORE.value:
      complete(evaluate)
      return 0
    report = evaluate.run_eval(
        _WORKDIR.value, step=_STEP.value, data=_DATA.value, tokenizer_path=_TOKENIZER.value,
        prompts=_PROMPT.value, max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value, top_p=_TOP_P.value, beam_size=_BEAM_SIZE.value,
        alpha=_ALPHA.value, max_examples=_MAX_EXAMPLES.value, out=_OUT.value,
        seq_len=_SEQ_LEN.value, rope_scaling=_ROPE_SCALING.value,
        rope_scaling_factor=_ROPE_FACTOR.value, position_buckets=_BUCKETS.value,
        tasks=_TASKS.value, task_dir=_TASK_DIR.value, task_limit=_TASK_LIMIT.value,
        task_batch_size=_TASK_BATCH.value, draft=_DRAFT.value)
    if _OUT.value is None:
      interrupts.on_signal(lambda name: f"{name} while sending the report to the run's "
                           f"trackers: {os.path.dirname(report['files'][0])} written (complete, "
                           "kept), the trackers may lack it; run the same command again to redo "
                           f"it: {interrupts.command()}")
      evaluate.log_to_trackers(_WORKDIR.value, report)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    interrupts.exit_quietly(2)
    return 2
  interrupts.exit_quietly(0)  # written and sent: what is left is printing it
  files = report.pop("files")
  print(json.dumps(report, indent=2))
  if "speculative" in report:
    print(speculative_line(report["speculative"]))
  for line in report.get("config_history", []):
    print(f"config history: {line}")
  if "loss_by_position" in report:
    print(f"loss by position (rows of {report['seq_len']}, trained at "
          f"{report['train_seq_len']}):")
    for bucket in report["loss_by_position"]["buckets"]:
      loss = "-" if bucket["loss"] is None else f"{bucket['loss']:.4f}"
      print(f"  {bucket['start']:>7}-{bucket['end'] - 1:<7} {loss}")
  print("wrote " + ", ".join(files))
  return 0


if __name__ == "__main__":
  # From the start (flags, JAX's import, the checkpoint's restore) a signal
  # exits 130/143 with one line; training/evaluate.py says what it stopped.
  interrupts.exit_on_signal(lambda name: f"{name} during start-up: stopped before evaluating, "
                            "nothing written; run the same command again: "
                            f"{interrupts.command()}")
  app.run(main, flags_parser=parse_flags)
