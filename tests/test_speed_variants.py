"""bench/speed_variants.py: every variant is a valid GPT-2 small config that
differs from the 2026-12-04 step in what its name says; the table puts each
measured step beside its prediction; bad input is one line, exit 2."""
import json

import pytest

from bench import speed_variants as sv
from configs.cli import load_config
from configs.validation import remat_name, validate
from tests.helpers import run_python


def _config(name):
  config = load_config(sv.CONFIG, sv.variant_flags(name))
  validate(config)
  return config


def test_each_variant_changes_what_its_name_says():
  base = _config("baseline")
  assert (remat_name(base.train.remat), base.train.loss_chunk_size, base.train.loss_impl,
          base.model.fp8, base.model.scan_layers, base.model.scan_unroll) == (
              "none", 0, "xla", "none", True, 2)  # the step the card timed on 2026-12-04
  assert _config("preset").to_dict() == load_config(sv.CONFIG).to_dict()
  assert _config("unscanned").model.scan_layers is False
  assert _config("scan_unrolled").model.scan_unroll == _config("baseline").model.num_layers
  assert remat_name(_config("remat_save_dots").train.remat) == "save_dots"
  assert remat_name(_config("remat_full").train.remat) == "full"
  assert _config("loss_chunks_4096").train.loss_chunk_size == 4096
  assert _config("fused_loss").train.loss_impl == "pallas"
  assert _config("fp8_delayed").model.fp8 == "delayed"
  mla = _config("mla")
  assert (mla.model.attention, mla.model.v_head_dim) == ("mla", 64)
  flat = lambda c: {f"{k}.{f}": v for k, part in c.to_dict().items() if isinstance(part, dict)
                    for f, v in part.items()}
  for name in set(sv.VARIANTS) - {"preset", "baseline"}:  # the rest is the baseline's
    own = {f.removeprefix("--config.").split("=")[0] for f in sv.variant_flags(name)
           if f not in sv.BASELINE}
    differ = {f for f, v in flat(_config(name)).items() if v != flat(base)[f]}
    assert differ <= own, (name, differ - own)


def test_table_puts_measured_beside_predicted(tmp_path):
  where = {"target": "gpu:h200", "commit": "abc1234"}
  predictions = {"baseline": {"predicted_ms": 80.0, "mfu_bound": 0.35, **where},
                 "fp8_delayed": {"predicted_ms": 78.0, "mfu_bound": 0.36, **where}}
  (tmp_path / "speed_baseline.json").write_text(json.dumps(
      {"rows": [{"name": "ours", "ms_per_step": 100.0, "mfu": 0.28}]}))
  lines = sv.table(tmp_path, predictions).splitlines()
  rows = {l.split("|")[1].strip(): l for l in lines if l.startswith("| ") and "variant" not in l}
  assert list(rows) == list(sv.VARIANTS)
  assert rows["baseline"] == ("| baseline | 80.0 | 35.0% | 100.0 | 28.0% | 1.25 "
                              "| gpu:h200, abc1234 |")
  assert rows["fp8_delayed"] == ("| fp8_delayed | 78.0 | 36.0% | not measured | n/a | n/a "
                                 "| gpu:h200, abc1234 |")
  assert rows["mla"] == "| mla | n/a | n/a | not measured | n/a | n/a | n/a |"


@pytest.mark.parametrize("args,message", [
    (["flags", "fp16"], "unknown variant 'fp16'"),
    (["table", "--measured_dir", ".", "--predictions", "nowhere.json"], "no predictions at"),
])
def test_bad_input_is_one_line(args, message):
  result = run_python(["-m", "bench.speed_variants", *args])
  assert result.returncode == 2
  assert result.stderr.strip().startswith("error:") and message in result.stderr
  assert "Traceback" not in result.stderr
