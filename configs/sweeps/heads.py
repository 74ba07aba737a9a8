"""Multi-head, grouped-query and multi-query attention on configs/tiny.py
(4 query heads; 4, 2 and 1 key/value heads) at equal training FLOPs.

Fewer key/value heads make a step cheaper, so a FLOP budget gives those
variants more steps: with 4.6e12 FLOPs, MHA trains 600 steps, GQA 633 and
MQA 652 (model/accounting.py).

  python sweep.py run --sweep configs/sweeps/heads.py --seeds 3 --config.train.flop_budget=4.6e12
  python sweep.py report --root runs/sweeps/heads
"""
NAME = "heads"
CONFIG = "configs/tiny.py"


def get_sweep():
  return {"model.num_kv_heads": [4, 2, 1]}
