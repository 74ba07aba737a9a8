"""bench/speculative.py's pass costs on the CPU: `--costs` times a
random-weight shape's greedy step, verification and drafts at each depth and
cache length and the drafted loop's own pass, `--products` an M-row product
against one row's; a run it cannot draft with is refused in one line, exit
2, before its checkpoint."""
import pytest

from bench import speculative
from configs import base
from tests.helpers import assert_one_line_error, run_python
from training import workdir as workdir_lib


def test_shape_costs_give_a_floor_per_depth_and_length():
  costs = speculative.shape_costs(["32x1"], depths=[1, 2], lengths=[16], repeats=1)
  assert [(c["draft_depth"], c["cache_length"]) for c in costs] == [(1, 16), (2, 16)]
  for c in costs:
    assert (c["d_model"], c["layers"]) == (32, 1)
    assert c["pass_floor_in_greedy_steps"] == pytest.approx(
        c["verify_in_greedy_steps"] + c["drafts_in_greedy_steps"])
    assert c["greedy_step_seconds"] > 0 and c["verify_seconds"] > 0
    # The loop's own pass, from generate and mtp_speculative at two lengths
    # (a difference of timings: at this size it can be noise of either sign).
    assert c["loop_pass_in_greedy_steps"] == pytest.approx(
        c["loop_pass_seconds"] / c["loop_greedy_step_seconds"])


def test_product_costs_time_each_row_count():
  (cost,) = speculative.product_costs([32], repeats=1, rows=(1, 2), layers=2, steps=2)
  assert (cost["d"], cost["weight_bytes"]) == (32, 12 * 32 * 32)
  assert sorted(cost["microseconds_by_rows"]) == [1, 2]
  assert all(us > 0 for us in cost["microseconds_by_rows"].values())


@pytest.mark.parametrize("depth, flags, fragments", [
    (0, [], ["trained without train.mtp_depth"]),
    (1, ["--depths", "1,2"], ["--depths 1,2", "has 1 MTP modules", "draft with 1 to 1"]),
])
def test_a_run_it_cannot_draft_with_is_one_line_exit_2(tmp_path, depth, flags, fragments):
  config = base.get_config()
  config.train.mtp_depth = depth
  workdir_lib.write_json_atomic(str(tmp_path / workdir_lib.CONFIG_FILE),
                                workdir_lib.config_to_dict(config))
  result = run_python(["-m", "bench.speculative", "--workdir", str(tmp_path), *flags,
                       "--out", str(tmp_path / "out.json")])
  assert result.returncode == 2
  assert_one_line_error(result, *fragments)
  assert not (tmp_path / "out.json").exists()
