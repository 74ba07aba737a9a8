"""lm-evaluation-harness tasks on our checkpoints (`training/downstream.py`).

Every task is a local YAML over a JSONL file that the test writes (nothing is
downloaded). Parity: a tiny random GPT-2 from `transformers`, imported with
convert.py, gives through our model the per-example log-likelihoods,
greedy flags, rolling log-likelihoods and generations that lm-eval's own
`hf` model gives through transformers (log-likelihoods within 1e-4).
"""
import json
import pathlib
import sys

import pytest

from configs import bert_mlm
from configs.errors import UserError
from configs.validation import validate
from tests.helpers import run_convert, run_python, save_hf, small_config, tiny_gpt2
from training import downstream, evaluate, loop
from training.metrics import read_metrics
from training.workdir import load_run

# Contexts of very different lengths (the last one is longer than GPT-2's 64
# positions, so it is cut from the left), a context with a trailing space and an
# empty one; choices of one to several tokens.
QUESTIONS = [
    ("def add(a, b):", [" return a + b", " pass", " class Foo: pass"], 0),
    ("class Foo", [":", " bar baz qux"], 0),
    ("hello ", ["world", "there, how are you doing"], 0),
    ("", ["def f(x): return x", "hello world"], 1),
    ("x = 1\n" * 30 + "def", [" add(a, b):", " f"], 1),
]
TEXTS = ["def add(a, b):\n    return a + b\n", "hello world " * 12, "class Foo: pass"]

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

ROLLING_YAML = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""

GENERATE_YAML = """task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: [")", "\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(directory) -> str:
  """The three local tasks (multiple choice, rolling, generation) and their data."""
  directory.mkdir(parents=True, exist_ok=True)
  questions = directory / "questions.jsonl"
  questions.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                               for q, c, a in QUESTIONS))
  texts = directory / "texts.jsonl"
  texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
  (directory / "tiny_mc.yaml").write_text(MC_YAML.format(data=questions))
  (directory / "tiny_rolling.yaml").write_text(ROLLING_YAML.format(data=texts))
  (directory / "tiny_generate.yaml").write_text(GENERATE_YAML.format(data=questions))
  return str(directory)


@pytest.fixture(scope="module")
def gpt2_run(tok, tmp_path_factory):
  """(transformers' tiny GPT-2, its saved directory, the run convert.py imports it to)."""
  import torch  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp("gpt2")
  torch.manual_seed(0)
  # As many rows as the tokenizer has ids: our generation never picks a row
  # past them (model/generate.py), transformers' would.
  hf_model = tiny_gpt2(vocab_size=tok.vocab_size).eval()
  hf_model.generation_config.eos_token_id = tok.eos_id  # transformers stops at our EOS too
  hf_dir = save_hf(hf_model, tok, root / "hf")
  assert run_convert("from_hf", "--hf_dir", hf_dir, "--workdir", root / "run") == 0
  return hf_model, hf_dir, str(root / "run")


def _hf_lm_class():
  """lm-eval's `hf` model class (its module needs transformers and accelerate)."""
  from lm_eval.models.huggingface import HFLM  # pylint: disable=import-outside-toplevel
  return HFLM


def _samples(results: dict, task: str) -> list:
  """Each example's responses, in document order."""
  return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.hf
@pytest.mark.lm_eval
def test_log_likelihoods_match_lm_eval_hf_model(gpt2_run, tmp_path):
  """Our batches (4 rows of different lengths, right-padded) against lm-eval's
  hf model one request at a time."""
  import transformers  # pylint: disable=import-outside-toplevel
  HFLM = _hf_lm_class()  # pylint: disable=invalid-name
  hf_model, hf_dir, workdir = gpt2_run
  tasks = downstream.load_tasks("tiny_mc,tiny_rolling,tiny_generate", write_tasks(tmp_path))
  config, tok, model, _ = load_run(workdir)
  assert len(tok.encode(TEXTS[1])) > config.model.max_len  # rolling: several windows
  ours = downstream.run_tasks(downstream.harness_model(model, config.model, tok, batch_size=4,
                                                       where="test"), tasks, log_samples=True)
  hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  theirs = downstream.run_tasks(HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=1,
                                     device="cpu"), tasks, log_samples=True)
  # lm-eval's hf model scores the BOS its tokenizer adds as part of a rolling
  # text; without it, its windows are ours.
  theirs_rolling = downstream.run_tasks(
      HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=1, device="cpu",
           add_bos_token=False), tasks._replace(names=("tiny_rolling",)), log_samples=True)
  choices, rolling = [], []
  for got, want in zip(_samples(ours, "tiny_mc"), _samples(theirs, "tiny_mc")):
    assert [g[0][1] for g in got] == [w[0][1] for w in want]  # greedy flags
    choices += [abs(g[0][0] - w[0][0]) for g, w in zip(got, want)]
  for got, want in zip(_samples(ours, "tiny_rolling"), _samples(theirs_rolling, "tiny_rolling")):
    rolling.append(abs(got[0][0] - want[0][0]))
  print(f"max |log-likelihood difference|: {max(choices):.1e} over {len(choices)} choices, "
        f"{max(rolling):.1e} over {len(rolling)} rolling texts")
  assert max(choices + rolling) < 1e-4
  generations = _samples(ours, "tiny_generate")
  assert generations == _samples(theirs, "tiny_generate")
  assert any(texts[0][0] for texts in generations)  # not all cut to nothing
  assert ours["results"]["tiny_mc"]["acc,none"] == theirs["results"]["tiny_mc"]["acc,none"]


def _eval_with_tasks(workdir, tmp_path, *flags) -> pathlib.Path:
  """eval.py of `workdir` on a small file with `flags`; the report's folder."""
  (tmp_path / "doc.txt").write_text("def f(a, b):\n    return a + b\n" * 4)
  result = run_python(["eval.py", "--workdir", workdir, "--data", str(tmp_path / "doc.txt"),
                       "--max_new_tokens", "2", *flags])
  assert result.returncode == 0, result.stderr[-2000:]
  return pathlib.Path(workdir) / "eval" / "step_0_data-doc.txt"


@pytest.mark.hf
@pytest.mark.lm_eval
def test_eval_py_tasks_writes_accuracy_into_the_eval_report(gpt2_run, tmp_path):
  _, _, workdir = gpt2_run
  out = _eval_with_tasks(workdir, tmp_path, "--tasks", "tiny_mc", "--task_dir",
                         write_tasks(tmp_path / "tasks"), "--task_batch_size", "2")
  tiny_mc = json.loads((out / "eval_report.json").read_text())["downstream"]["tiny_mc"]
  assert 0 <= tiny_mc["metrics"]["acc"]["value"] <= 1 and tiny_mc["metrics"]["acc"]["stderr"] > 0
  assert (tiny_mc["samples"], tiny_mc["num_fewshot"], tiny_mc["limit"]) == (len(QUESTIONS), 0,
                                                                             None)
  assert (out / "downstream.png").exists()


@pytest.mark.hf
@pytest.mark.lm_eval
@pytest.mark.slow
def test_tasks_evaluated_later_on_the_same_step_join_the_report(gpt2_run, tmp_path):
  _, _, workdir = gpt2_run
  task_dir = write_tasks(tmp_path / "tasks")
  out = _eval_with_tasks(workdir, tmp_path, "--tasks", "tiny_mc", "--task_dir", task_dir)
  tiny_mc = json.loads((out / "eval_report.json").read_text())["downstream"]["tiny_mc"]
  report = evaluate.run_eval(workdir, data=str(tmp_path / "doc.txt"), max_new_tokens=2,
                             tasks="tiny_rolling", task_dir=task_dir, task_limit=2)
  assert report["downstream"]["tiny_mc"] == tiny_mc
  assert report["downstream"]["tiny_rolling"]["samples"] == 2
  assert set(report["downstream"]["tiny_rolling"]["metrics"]) == {"word_perplexity",
                                                                  "bits_per_byte"}


@pytest.mark.lm_eval
def test_an_unknown_task_is_one_line_naming_the_closest(tmp_path):
  task_dir = write_tasks(tmp_path)
  with pytest.raises(UserError) as error:
    downstream.load_tasks("tiny_mc,hellaswg", task_dir, field="--tasks",
                          dir_field="--task_dir")
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"--tasks: 'hellaswg' is neither a task of --task_dir={task_dir!r} "
                            "nor an lm-eval task (closest: hellaswag")
  assert message.endswith("; `lm-eval ls tasks` lists lm-eval's")


def test_without_lm_eval_the_hint_is_one_line(monkeypatch):
  """train.py and eval.py, lm-eval not installed: the install hint in one line."""
  monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
  with pytest.raises(UserError, match=r"^--tasks runs lm-evaluation-harness tasks, which is not "
                     r"installed: pip install lm-eval$"):
    downstream.load_tasks("hellaswag", field="--tasks")


@pytest.mark.lm_eval
def test_generation_arguments_our_sampler_does_not_take_are_refused():
  assert downstream._generation_options(  # pylint: disable=protected-access
      {"until": ["\n"], "max_gen_toks": 5}) == (["\n"], 5, {"temperature": 0.0})
  with pytest.raises(UserError, match=r"generation arguments \['num_beams'\]"):
    downstream._generation_options({"until": ["\n"], "num_beams": 4})  # pylint: disable=protected-access


@pytest.mark.parametrize("fields, fragment", [
    (dict(downstream_tasks="hellaswag,,arc_easy"), "has an empty task name"),
    (dict(downstream_tasks="hellaswag,hellaswag"), "names a task twice"),
    (dict(downstream_task_dir="tasks"), "train.downstream_tasks, which is empty"),
    (dict(downstream_tasks="hellaswag", downstream_limit=-1), "train.downstream_limit=-1"),
    (dict(downstream_tasks="hellaswag", downstream_batch_size=0),
     "train.downstream_batch_size=0"),
])
def test_bad_downstream_fields_are_one_line(fields, fragment):
  config = small_config("")
  config.train.update(**fields)
  with pytest.raises(UserError, match=fragment) as error:
    validate(config)
  assert "\n" not in str(error.value)


def test_downstream_tasks_need_a_decoder_language_model():
  config = bert_mlm.get_config()
  config.train.downstream_tasks = "hellaswag"
  with pytest.raises(UserError, match="train.downstream_tasks='hellaswag': lm-eval tasks score "
                     "a decoder language model, this one is model.family=encoder"):
    validate(config)


@pytest.mark.lm_eval
def test_downstream_tasks_in_the_training_loop(tok_dir, tmp_path):
  """train.downstream_tasks at every validation pass: metrics.jsonl's
  `downstream` records, `downstream/<task>/<metric>`."""
  config = small_config(tok_dir, str(tmp_path / "cache"))
  config.train.update(num_steps=4, eval_every=2, checkpoint_every=4, downstream_tasks="tiny_mc",
                      downstream_task_dir=write_tasks(tmp_path / "tasks"), downstream_limit=3,
                      downstream_batch_size=4)
  last = loop.train(config, str(tmp_path / "run"))
  records = [r for r in read_metrics(str(tmp_path / "run")) if r["split"] == "downstream"]
  assert [r["step"] for r in records] == [2, 4]
  assert all(0 <= r["downstream/tiny_mc/acc"] <= 1 for r in records)
  assert last["downstream/tiny_mc/acc"] == records[-1]["downstream/tiny_mc/acc"]
