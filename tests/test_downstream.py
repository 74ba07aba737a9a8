"""lm-evaluation-harness tasks on our checkpoints (`training/downstream.py`).

Every task is a local YAML over a JSONL file that the test writes, or the
repository's python_next_line (nothing is downloaded: a Hugging Face Hub
dataset is either refused, with the Hub at a closed loopback port, or read
from a cache the test fills). Parity: a tiny random GPT-2 from
`transformers`, imported with convert.py, gives through our model the per-example log-likelihoods,
greedy flags, rolling log-likelihoods and generations that lm-eval's own
`hf` model gives through transformers (log-likelihoods within 1e-4).
"""
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from configs import bert_mlm
from configs.errors import UserError
from configs.validation import validate
from tests.helpers import ROOT, TINY, run_convert, run_python, save_hf, small_config, tiny_gpt2
from training import downstream, downstream_sources, evaluate, loop
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
                     r"installed: run make install-eval \(pip install -r "
                     r"requirements-eval.txt\)$"):
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


# Tasks whose data is on the Hugging Face Hub, which is never reached here: its
# endpoint is a closed loopback port and the Hugging Face cache a folder of the test.

CLOSED_HUB = "http://127.0.0.1:9"  # nothing listens on the discard port of loopback

HUB_YAML = """task: hub_mc
dataset_path: myorg/mydata
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""

GROUP_YAMLS = {
    "local.yaml": MC_YAML.format(data="questions.jsonl").replace("tiny_mc", "local_mc"),
    "hub.yaml": HUB_YAML.replace("hub_mc", "hub_a") + "dataset_name: x\ntag: hub_tag\n",
    "files.yaml": MC_YAML.format(data="hf://datasets/org/b/q.jsonl").replace("tiny_mc", "files_mc"),
    "group.yaml": """group: grp
task:
  - local_mc
  - task: hub_a
    dataset_name: y
  - task: inline_mc
    dataset_path: org/c
  - group: inner
    task: [hub_tag, files_mc]
""",
}


def _hf_env(hf_home, **variables) -> dict:
  """This process's environment with no HF_ variable but HF_HOME, the closed
  Hub and `variables`."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
  return dict(env, HF_HOME=str(hf_home), HF_ENDPOINT=CLOSED_HUB, **variables)


def _run(args, env) -> tuple[subprocess.CompletedProcess, float]:
  """`python args...` in the repository root with `env`; (the result, seconds)."""
  start = time.perf_counter()
  result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  return result, time.perf_counter() - start


def _one_line(result) -> str:
  """The one line a user error prints (exit status 2)."""
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  return lines[0]


def _cache_hub_dataset(hf_home, repo: str, rows: list[dict]) -> None:
  """`rows` as `datasets` keeps a Hub dataset it has loaded (its `test` split)
  in HF_HOME's cache: what a run on a connected machine leaves behind."""
  data = pathlib.Path(hf_home) / "source.jsonl"
  data.parent.mkdir(parents=True, exist_ok=True)
  data.write_text("".join(json.dumps(row) + "\n" for row in rows))
  import datasets  # pylint: disable=import-outside-toplevel
  datasets.load_dataset("json", data_files={"test": str(data)}, cache_dir=str(data.parent / "tmp"))
  (info_file,) = glob.glob(str(data.parent / "tmp" / "json" / "*" / "*" / "*" /
                                "dataset_info.json"))
  built = os.path.dirname(info_file)
  namespace, name = repo.split("/")
  target = pathlib.Path(hf_home, "datasets", f"{namespace}___{name}", "default", "0.0.0",
                        os.path.basename(built))
  target.mkdir(parents=True)
  shutil.copy(os.path.join(built, "json-test.arrow"), target / f"{name}-test.arrow")
  info = json.loads(pathlib.Path(info_file).read_text())
  info.update(builder_name=name, dataset_name=name)
  (target / "dataset_info.json").write_text(json.dumps(info))
  shutil.rmtree(data.parent / "tmp")


def _never_asked(endpoint):
  raise AssertionError(f"asked the Hub at {endpoint}")


@pytest.fixture(scope="module")
def tiny_run(tok_dir, tmp_path_factory):
  """A decoder trained two steps (eval.py's workdir), with room for a line
  of python_next_line (80 characters) unconditioned (acc_mutual_info)."""
  workdir = tmp_path_factory.mktemp("tiny") / "run"
  config = small_config(tok_dir, str(workdir.parent / "cache"))
  config.model.max_len = 128
  config.train.update(num_steps=2, eval_every=2, checkpoint_every=2)
  loop.train(config, str(workdir))
  return workdir


@pytest.fixture(name="offline_datasets")
def fixture_offline_datasets(tmp_path, monkeypatch):
  """`datasets` of this process pointed at the closed Hub and an empty cache
  (its settings are read at import); returns the cache."""
  import datasets.config  # pylint: disable=import-outside-toplevel
  cache = tmp_path / "hf" / "datasets"
  for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
    monkeypatch.delenv(variable, raising=False)
  monkeypatch.setattr(datasets.config, "HF_ENDPOINT", CLOSED_HUB)
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
  return cache


@pytest.mark.lm_eval
def test_eval_py_refuses_a_hub_task_it_cannot_reach_in_one_line_within_seconds(tiny_run,
                                                                               tmp_path):
  """The README's `eval.py --tasks arc_easy` offline: one line, exit 2, no minute of retries."""
  result, seconds = _run(["eval.py", "--workdir", tiny_run, "--tasks", "arc_easy",
                          "--task_limit", "5"], _hf_env(tmp_path / "hf"))
  line = _one_line(result)
  assert line.startswith("error: --tasks: arc_easy needs allenai/ai2_arc (ARC-Easy) from the "
                         f"Hugging Face Hub, not in the local cache ({tmp_path / 'hf'}/datasets)"
                         f", and the Hub ({CLOSED_HUB}, HF_ENDPOINT) does not answer ("), line
  assert "--task_dir with your task YAMLs" in line
  assert line.endswith("with HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 set"), line
  assert seconds < 45  # not the minute of retries; room for a busy machine's start-up
  assert not (tiny_run / "eval").exists()


@pytest.mark.lm_eval
def test_train_refuses_a_hub_task_it_cannot_reach_at_start_up(tmp_path):
  """train.downstream_tasks: before anything is trained or written."""
  result, seconds = _run(["train.py", "--config", TINY, "--workdir", tmp_path / "run",
                          "--config.train.downstream_tasks=arc_easy"], _hf_env(tmp_path / "hf"))
  line = _one_line(result)
  assert line.startswith("error: train.downstream_tasks: arc_easy needs allenai/ai2_arc "
                         "(ARC-Easy) from the Hugging Face Hub, not in the local cache"), line
  assert f"the Hub ({CLOSED_HUB}, HF_ENDPOINT) does not answer" in line
  assert "train.downstream_task_dir with your task YAMLs" in line
  assert seconds < 45  # as above: no minute of retries
  assert not (tmp_path / "run").exists()


@pytest.mark.lm_eval
def test_the_shipped_task_and_a_cached_hub_dataset_run_offline(tiny_run, tmp_path):
  """python_next_line needs no --task_dir and no network; a Hub dataset in
  the HF cache loads with the offline variables set."""
  _cache_hub_dataset(tmp_path / "hf", "myorg/mydata", [
      {"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS])
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  (tasks / "hub_mc.yaml").write_text(HUB_YAML)
  (tmp_path / "doc.txt").write_text("def f(a, b):\n    return a + b\n")
  result, _ = _run(["eval.py", "--workdir", tiny_run, "--data", tmp_path / "doc.txt",
                    "--tasks", "python_next_line,hub_mc", "--task_dir", tasks, "--task_limit",
                    "2", "--task_batch_size", "64", "--out", tmp_path / "out"],
                   _hf_env(tmp_path / "hf", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads((tmp_path / "out" / "eval_report.json").read_text())["downstream"]
  assert set(report["python_next_line"]["metrics"]) == {"acc", "acc_norm", "acc_mutual_info"}
  assert all(0 <= m["value"] <= 1 for m in report["python_next_line"]["metrics"].values())
  assert (report["python_next_line"]["samples"], report["hub_mc"]["samples"]) == (2, 2)


@pytest.mark.lm_eval
def test_the_shipped_task_is_found_without_indexing_lm_evals_own():
  tasks = downstream.load_tasks("python_next_line", field="--tasks", dir_field="--task_dir")
  assert "python_next_line" in tasks.manager.all_tasks
  assert "arc_easy" not in tasks.manager.all_tasks  # lm-eval's 15,000 YAMLs not read


@pytest.mark.lm_eval
def test_the_hub_datasets_of_groups_tags_and_inline_tasks(tmp_path):
  """What each leaf task reads, as lm-eval's TaskFactory builds the group:
  a member's overrides win, a local or packaged dataset reads nothing."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  for name, text in GROUP_YAMLS.items():
    (tmp_path / name).write_text(text)
  manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
  Source = downstream_sources.Source  # pylint: disable=invalid-name
  sources = [downstream_sources.source(c)
             for c in downstream_sources.leaf_configs(manager.task_index, "grp")]
  assert sources == [None, Source("myorg/mydata", "y"), Source("org/c", None),
                     Source("myorg/mydata", "x"), Source("org/b", None, files=True)]


@pytest.mark.lm_eval
def test_offline_without_the_dataset_cached_is_one_line_asking_nothing(tmp_path, monkeypatch,
                                                                       offline_datasets):
  del offline_datasets
  import datasets.config  # pylint: disable=import-outside-toplevel
  (tmp_path / "hub_mc.yaml").write_text(HUB_YAML)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(downstream_sources, "hub_failure", _never_asked)
  with pytest.raises(UserError) as error:
    downstream.load_tasks("hub_mc", str(tmp_path))
  assert str(error.value).startswith("train.downstream_tasks: hub_mc needs myorg/mydata from the "
                                     "Hugging Face Hub, not in the local cache (")
  assert "and HF_HUB_OFFLINE is set; run a local task instead" in str(error.value)


@pytest.mark.lm_eval
def test_a_cached_dataset_passes_offline_and_online_asks_for_offline(tmp_path, monkeypatch,
                                                                     offline_datasets):
  """Cached: offline, nothing is asked; online with the Hub down, the way to
  use the cache (datasets would retry the Hub for a minute first)."""
  import datasets.config  # pylint: disable=import-outside-toplevel
  (tmp_path / "hub_mc.yaml").write_text(HUB_YAML)
  cached = offline_datasets / "myorg___mydata" / "default" / "0.0.0" / "abc"
  cached.mkdir(parents=True)
  (cached / "dataset_info.json").write_text("{}")
  with pytest.raises(UserError, match=r"^train.downstream_tasks: hub_mc needs myorg/mydata from "
                     r"the Hugging Face Hub, in the local cache \(.*\), but the Hub "
                     r"\(http://127.0.0.1:9, HF_ENDPOINT\) does not answer \(.*\); set "
                     r"HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 to use the cached copy"):
    downstream.load_tasks("hub_mc", str(tmp_path))
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setattr(downstream_sources, "hub_failure", _never_asked)
  assert downstream.load_tasks("hub_mc", str(tmp_path)).names == ("hub_mc",)


# Task names registered in ways a file's own text may not show: through an
# include (at two depths, one a file whose name has no .yaml), a tag given by a
# template, a duplicate task name (the first in TaskIndex's order wins), a group.
TRICKY_YAMLS = {
    "a/_base_yaml": "include: ../common/_inner_yaml\ndataset_path: org/base\n",
    "common/_inner_yaml": "tag: [from_template]\noutput_type: multiple_choice\n",
    "a/t1.yaml": "include: _base_yaml\ntask: t1\n",
    "a/t2.yaml": "include: _base_yaml\ntask: t2\ndataset_name: two\n",
    "b/dup.yaml": "task: t1\ndataset_path: org/dup\n",
    "b/grp.yaml": "group: g\ntask: [t2, from_template]\n",
    "c/broken.yaml": "task: [t1\n",
}


def _fields(entry):
  """What an lm-eval index entry says (None: no entry)."""
  return entry and (entry.name, entry.kind, entry.yaml_path, entry.tags, entry.cfg)


@pytest.mark.lm_eval
def test_the_quick_index_finds_what_task_index_registers(tmp_path):
  """QuickIndex over a folder of YAMLs gives each name the entry that
  lm-eval's TaskIndex gives it from the whole folder."""
  from lm_eval.tasks._index import TaskIndex  # pylint: disable=import-outside-toplevel
  for name, text in TRICKY_YAMLS.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  whole = TaskIndex.build([tmp_path])
  quick = downstream_sources.QuickIndex({}, root=tmp_path)
  assert set(whole) == {"t1", "t2", "from_template", "g"}
  for name in [*whole, "_base_yaml", "none"]:
    assert _fields(quick.get(name)) == _fields(whole.get(name)), name
  assert [downstream_sources.source(c) for c in downstream_sources.leaf_configs(quick, "g")] == [
      downstream_sources.Source("org/base", "two"), downstream_sources.Source("org/base", None),
      downstream_sources.Source("org/base", "two")]


@pytest.mark.lm_eval
@pytest.mark.slow
def test_the_quick_index_gives_the_entries_of_lm_evals_whole_index():
  """QuickIndex parses only the YAMLs that can define a name: every 50th name
  of lm-eval's index and some groups and tags get the same entry as there
  (run it when lm-eval is upgraded)."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  whole = TaskManager().task_index
  quick = downstream_sources.QuickIndex({})
  names = sorted(whole)[::50] + ["mmlu", "ai2_arc", "lambada", "leaderboard", "no_such_task"]
  assert [n for n in names if _fields(quick.get(n)) != _fields(whole.get(n))] == []
  assert ([downstream_sources.source(c) for c in downstream_sources.leaf_configs(quick, "mmlu")]
          == [downstream_sources.source(c) for c in downstream_sources.leaf_configs(whole, "mmlu")])
