"""Every validation rule of configs/validation.py has a test of its message."""
import importlib
import pathlib

import pytest

from configs import base
from configs.errors import UserError
from configs.validation import validate, validate_model

CASES = [
    (dict(family="gpt"), "model.family='gpt': must be one of decoder, encoder, encoder_decoder"),
    (dict(pos_emb="xpos"), "model.pos_emb='xpos': must be one of none, sinusoidal, learned"),
    (dict(rope_scaling="dynamic"), "model.rope_scaling='dynamic': must be one of none, linear"),
    (dict(norm="batchnorm"), "model.norm='batchnorm': must be one of layernorm, rmsnorm"),
    (dict(norm_position="sandwich"), "model.norm_position='sandwich': must be one of pre, post"),
    (dict(mlp="reglu"), "model.mlp='reglu': must be one of gelu, gelu_tanh, relu, swiglu"),
    (dict(attention_impl="flash"), "model.attention_impl='flash': must be one of reference, xla"),
    (dict(dtype="int8"), "model.dtype='int8': must be one of float32, bfloat16, float16"),
    (dict(pallas_lowering="cuda"),
     "model.pallas_lowering='cuda': must be one of auto, triton, mosaic_gpu, mosaic_tpu"),
    (dict(param_dtype="float16"), "model.param_dtype='float16': must be one of float32, bfloat16"),
    (dict(d_model=0), "model.d_model=0: must be a positive integer"),
    (dict(num_kv_heads=0), "model.num_kv_heads=0: must be a positive integer"),
    (dict(d_model=130), "model.d_model=130: must be divisible by model.num_heads=4"),
    (dict(num_kv_heads=3), "model.num_kv_heads=3: must divide model.num_heads=4"),
    (dict(head_dim=15), "model.head_dim=15: must be even for pos_emb=rope"),
    (dict(pos_emb="sinusoidal", d_model=129, head_dim=32),
     "model.d_model=129: must be even for pos_emb=sinusoidal"),
    (dict(rope_theta=0.0), "model.rope_theta=0.0: must be positive"),
    (dict(rope_scaling_factor=0.5), "model.rope_scaling_factor=0.5: must be >= 1"),
    (dict(pos_emb="learned", rope_scaling="linear"),
     "model.rope_scaling='linear': needs model.pos_emb=rope"),
    (dict(norm_eps=0.0), "model.norm_eps=0.0: must be positive"),
    (dict(scan_unroll=0), "model.scan_unroll=0: must be a positive integer (blocks per iteration)"),
    (dict(rope_original_max_len=0), "model.rope_original_max_len=0: must be a positive integer"),
    (dict(rope_scaling="yarn", rope_beta_fast=1.0),
     "model.rope_beta_fast=1.0: must exceed model.rope_beta_slow=1.0 > 0"),
    (dict(pos_emb="rope", rope_scaling="yarn", rope_attention_factor=0.0),
     "model.rope_attention_factor=0.0: must be positive"),
    (dict(rope_scaling="linear", rope_attention_factor=1.2),
     "model.rope_attention_factor=1.2: is for model.rope_scaling=yarn (not linear)"),
    (dict(rope_scaling="llama3", rope_high_freq_factor=1.0),
     "model.rope_high_freq_factor=1.0: must exceed model.rope_low_freq_factor=1.0 > 0"),
    (dict(attention_scale=0.0), "model.attention_scale=0.0: must be positive (1.0 for unscaled"),
    (dict(sliding_window=0), "model.sliding_window=0: must be a positive integer"),
    (dict(type_vocab_size=-1), "model.type_vocab_size=-1: must be a positive integer or 0"),
    (dict(sliding_window=8, family="encoder"),
     "model.sliding_window=8: is for causal decoders (model.family=decoder, not encoder)"),
    (dict(real_vocab_size=0), "model.real_vocab_size=0: must be a positive integer"),
    (dict(real_vocab_size=1025), "model.real_vocab_size=1025: must be <= model.vocab_size=1024 "
     "(the rows past it are padding)"),
    (dict(sliding_window_layers=(1,)),
     "model.sliding_window_layers=(1,): needs model.sliding_window"),
    (dict(sliding_window=8, sliding_window_layers=()),
     "model.sliding_window_layers=(): must be a non-empty tuple of layer indices"),
    (dict(sliding_window=8, sliding_window_layers=(1, 1)),
     "model.sliding_window_layers=(1, 1): must name distinct layers in 0..1"),
    (dict(sliding_window=8, sliding_window_layers=(2,)),
     "model.sliding_window_layers=(2,): must name distinct layers in 0..1 (model.num_layers=2)"),
    (dict(layer_types=()), "model.layer_types=(): must be a non-empty tuple of layer kinds"),
    (dict(layer_types=("full_attention", "linear")), "model.layer_types='linear': is not a "
     "layer kind: use one of full_attention, sliding_attention, linear_attention, each "
     "optionally followed by +moe"),
    (dict(layer_types=("full_attention",) * 3), "model.layer_types=('full_attention', "
     "'full_attention', 'full_attention'): has 3 kinds for 2 layers (model.num_layers)"),
    (dict(layer_types=("sliding_attention",)),
     "model.layer_types=('sliding_attention',): has sliding_attention layers but "
     "model.sliding_window is None"),
    (dict(layer_types=("full_attention",), sliding_window=8),
     "model.sliding_window=8: is set but no kind of model.layer_types is sliding_attention"),
    (dict(layer_types=("sliding_attention",), sliding_window=8, sliding_window_layers=(1,)),
     "model.sliding_window_layers=(1,): describes the layers a second time beside "
     "model.layer_types"),
    (dict(layer_types=("full_attention+moe",)), "model.layer_types=('full_attention+moe',): "
     "has +moe layers but model.num_experts=0"),
    (dict(layer_types=("full_attention",), num_experts=4),
     "model.num_experts=4: is set but no kind of model.layer_types ends in +moe"),
]


@pytest.mark.parametrize("overrides,message", CASES)
def test_model_rule_messages(overrides, message):
  m = base.get_config().model
  m.update(**overrides)
  with pytest.raises(UserError) as err:
    validate_model(m)
  assert str(err.value).startswith("config field " + message)
  assert "\n" not in str(err.value)


# What a kernel takes is declared by model/kernels and checked by the model
# (`ModelConfig.resolve`, which `build_model` runs), not by configs/.
KERNEL_CASES = [
    (dict(pallas_lowering="mosaic_gpu", d_model=128, num_heads=2),
     "model.pallas_lowering='mosaic_gpu': needs model.dtype bfloat16 or float16, not float32"),
    (dict(pallas_lowering="mosaic_gpu", dtype="bfloat16"),
     "model.pallas_lowering='mosaic_gpu': needs a head_dim of 64 or 128, not 32"),
    (dict(attention_impl="pallas", pos_emb="alibi"),
     "model.pos_emb='alibi': attention_impl=pallas takes no additive bias (option `bias`)"),
]


@pytest.mark.parametrize("overrides,message", KERNEL_CASES)
def test_kernel_support_messages(overrides, message):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from model import build_model  # pylint: disable=import-outside-toplevel
  m = base.get_config().model
  m.update(**overrides)
  with pytest.raises(UserError) as err:
    build_model(m, nnx.Rngs(0))
  assert str(err.value).startswith("config field " + message)
  assert "\n" not in str(err.value)


RUN_CASES = [
    ("train.objective", "mlm", "train.objective='mlm': does not fit model.family=decoder"),
    ("train.seq_len", 512, "train.seq_len=512: exceeds the learned position table"),
    ("train.grad_accum_steps", 3, "train.grad_accum_steps=3: must divide train.batch_size=16"),
    ("train.learning_rate", 0.0, "train.learning_rate=0.0: must be positive"),
    ("train.embedding_lr_mult", -1.0, "train.embedding_lr_mult=-1.0: must be positive"),
    ("train.num_steps", 0, "train.num_steps=0: must be a positive integer"),
    ("train.warmup_steps", -1, "train.warmup_steps=-1: must be a positive integer or 0"),
    ("tokenizer.vocab_size", 4096, "tokenizer.vocab_size=4096: exceeds model.vocab_size=1024"),
    ("tokenizer.kind", "wordpiece", "tokenizer.kind='wordpiece': must be one of bpe"),
    ("data.source", "c4", "data.source='c4': must be one of stdlib"),
    ("data.packing", "pad", "data.packing='pad': must be one of packed, concat"),
    ("data.val_percent", 100, "data.val_percent=100: must be in [0, 100)"),
    ("mesh.fsdp", 0, "mesh.fsdp=0: must be a positive integer or -1"),
    ("data.task", "translate", "data.task='translate': must be one of none, reverse, sort"),
    ("data.task", "sort", "data.task='sort': needs train.objective=seq2seq (is next_token)"),
    ("data.task_size", 0, "data.task_size=0: must be a positive integer"),
    ("data.task_addition_format", "reversed",
     "data.task_addition_format='reversed': must be one of plain, aligned"),
    ("data.task_max_len", 2, "data.task_max_len=2: must be >= data.task_min_len=4"),
    ("data.task_test_min_len", 30, "data.task_test_min_len=30: must be 0 or in "
     "[data.task_min_len, data.task_max_len] = [4, 24]"),
    ("train.tgt_seq_len", 512, "train.tgt_seq_len=512: exceeds the learned position table"),
    ("train.tgt_seq_len", -1, "train.tgt_seq_len=-1: must be a positive integer or 0"),
    ("train.mlm_probability", 1.5, "train.mlm_probability=1.5: must be in (0, 1)"),
    ("data.seed", -1, "data.seed=-1: must be a positive integer or 0"),
    ("train.token_budget", -1.0, "train.token_budget=-1.0: must be >= 0 (0: unused)"),


    ("train.optimizer", "sgd", "train.optimizer='sgd': must be one of adamw, adafactor, lion, "
     "muon"),
    ("train.schedule", "step", "train.schedule='step': must be one of cosine, linear, constant, "
     "inverse_sqrt, wsd"),
    ("train.lion_b1", 0.95, "train.lion_b1=0.95: is for train.optimizer=lion (not adamw); "
     "unset it"),
    ("train.decay_fraction", 0.1, "train.decay_fraction=0.1: is for train.schedule=wsd (not "
     "cosine); unset it"),
    ("train.b2", 1.0, "train.b2=1.0: must be in [0, 1)"),
    ("train.min_lr_ratio", 1.5, "train.min_lr_ratio=1.5: must be in [0, 1]"),
    ("train.weight_decay", -0.1, "train.weight_decay=-0.1: must be in [0, inf)"),
    ("train.restore_branch", True, "train.restore_branch=True: needs train.restore_from (the "
     "run to branch from); set it or unset this"),
    ("train.restore_step", 400, "train.restore_step=400: needs train.restore_from (the run "
     "whose checkpoint it names); set it or unset this"),
    ("train.restore_step", 0, "train.restore_step=0: must be"),
    ("train.trackers", "tensorboard,neptune", "train.trackers='tensorboard,neptune': 'neptune' "
     "is not a tracker; name some of tensorboard, wandb, mlflow"),
    ("train.trackers", "wandb,wandb", "train.trackers='wandb,wandb': names wandb twice"),
    ("train.profile_steps", "10", "train.profile_steps='10': must be \"first,last\", two step "
     "numbers with 1 <= first <= last <= train.num_steps=1000"),
    ("train.profile_steps", "15,10", "train.profile_steps='15,10': must be \"first,last\""),
    ("train.profile_steps", "990,1001", "train.profile_steps='990,1001': must be"),
    ("train.profile_steps", "0,3", "train.profile_steps='0,3': must be"),
]


@pytest.mark.parametrize("field,value,message", RUN_CASES)
def test_run_rule_messages(field, value, message):
  c = base.get_config()
  c.model.pos_emb = "learned"
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(UserError) as err:
    validate(c)
  assert str(err.value).startswith("config field " + message)


OPTIMIZER_CASES = [
    (dict(optimizer="muon", muon_lr=0.0), "train.muon_lr=0.0: must be positive"),
    (dict(optimizer="muon", muon_momentum=1.0), "train.muon_momentum=1.0: must be in [0, 1)"),
    (dict(optimizer="muon", muon_ns_steps=0), "train.muon_ns_steps=0: must be a positive integer"),
    (dict(optimizer="muon", muon_rms=-0.2), "train.muon_rms=-0.2: must be in [0, inf)"),
    (dict(optimizer="lion", lion_b2=-0.5), "train.lion_b2=-0.5: must be in [0, 1)"),
    (dict(optimizer="adafactor", adafactor_decay_rate=0.0),
     "train.adafactor_decay_rate=0.0: must be in (0, 1]"),
    (dict(optimizer="adafactor", adafactor_clipping=-1.0),
     "train.adafactor_clipping=-1.0: must be in [0, inf)"),
    (dict(optimizer="adafactor", adafactor_min_dim_to_factor=0),
     "train.adafactor_min_dim_to_factor=0: must be a positive integer"),
    (dict(schedule="wsd", decay_fraction=0.0), "train.decay_fraction=0.0: must be in (0, 1]"),
    (dict(schedule="wsd", decay_fraction=0.0004), "train.decay_fraction=0.0004: must leave the "
     "decay at least one step, after the warm-up: 0.0004 x num_steps=1000 is 0 steps, and "
     "train.warmup_steps=100; change either"),
    (dict(schedule="wsd", decay_fraction=0.95), "train.decay_fraction=0.95: must leave the decay "
     "at least one step, after the warm-up: 0.95 x num_steps=1000 is 950 steps, and "
     "train.warmup_steps=100; change either"),
    (dict(schedule="inverse_sqrt", warmup_steps=0), "train.warmup_steps=0: must be >= 1 for "
     "train.schedule=inverse_sqrt (learning_rate * sqrt(warmup_steps / step) after it)"),
]


@pytest.mark.parametrize("train,message", OPTIMIZER_CASES)
def test_optimizer_and_schedule_rule_messages(train, message):
  """Each in one line: the field, its value, the fix."""
  c = base.get_config()
  c.train.update(**train)
  with pytest.raises(UserError) as err:
    validate(c)
  assert str(err.value).startswith("config field " + message)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("family,objective,allowed", [
    ("encoder", "seq2seq", "mlm, classify"), ("encoder_decoder", "next_token", "seq2seq"),
    ("decoder", "mlm", "next_token, seq2seq, classify")])
def test_objective_must_fit_the_family(family, objective, allowed):
  c = base.get_config()
  c.model.family, c.train.objective = family, objective
  with pytest.raises(UserError) as err:
    validate(c)
  assert str(err.value) == (f"config field train.objective={objective!r}: does not fit "
                            f"model.family={family}; use one of {allowed}")


def test_tokenizer_must_fit_the_real_vocabulary():
  """Ids past model.real_vocab_size would have masked logits."""
  c = base.get_config()
  c.model.update(vocab_size=1024, real_vocab_size=1000)
  with pytest.raises(UserError, match="tokenizer.vocab_size=1024: exceeds "
                                      "model.real_vocab_size=1000"):
    validate(c)


def test_user_data_needs_paths():
  c = base.get_config()
  c.data.source = "jsonl"
  with pytest.raises(UserError, match="data.paths='': is required for data.source=jsonl"):
    validate(c)


CONFIG_DIR = pathlib.Path(__file__).parents[1] / "configs"
PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if "def get_config(" in p.read_text())


def test_presets_are_found():
  assert {"base", "tiny", "gpt2_small", "llama2_7b", "bert_mlm"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_valid_and_has_every_field(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  validate(config)
  defaults = base.get_config()
  assert {s: set(config[s].keys()) for s in defaults} == {s: set(defaults[s].keys())
                                                           for s in defaults}


def test_saved_run_config_gets_new_fields_at_their_defaults(tmp_path):
  """A run saved before a field existed loads with the field at its default
  (the behaviour it was trained with); saved values stay."""
  import json  # pylint: disable=import-outside-toplevel
  from training import workdir  # pylint: disable=import-outside-toplevel
  saved = workdir.config_to_dict(base.get_config())
  del saved["data"]["task_addition_format"], saved["model"]["pallas_lowering"]
  saved["model"]["d_model"] = 48
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config = workdir.load_config(str(tmp_path))
  assert config.data.task_addition_format == "plain"
  assert config.model.pallas_lowering == "auto"
  assert config.model.d_model == 48


def test_one_budget_at_a_time_and_a_saved_run_without_them_keeps_its_seeds(tmp_path):
  import json  # pylint: disable=import-outside-toplevel
  from configs.validation import data_seed  # pylint: disable=import-outside-toplevel
  from training import workdir  # pylint: disable=import-outside-toplevel
  c = base.get_config()
  c.train.token_budget, c.train.flop_budget = 1e6, 1e12
  with pytest.raises(UserError, match=r"train.flop_budget=1000000000000.0: and "
                     r"train.token_budget=1e\+06 both set train.num_steps"):
    validate(c)
  saved = workdir.config_to_dict(base.get_config())
  saved["train"]["seed"] = 5
  del saved["data"]["seed"], saved["train"]["token_budget"], saved["train"]["flop_budget"]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config = workdir.load_config(str(tmp_path))
  assert (config.data.seed, data_seed(config), config.train.flop_budget) == (None, 5, 0)
