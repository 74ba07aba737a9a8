"""Positional scheme x norm placement on configs/tiny.py: 4 x 2 = 8 variants.

  python sweep.py run --sweep configs/sweeps/pos_norm.py [--parallel 2]
  python sweep.py run --sweep configs/sweeps/pos_norm.py --launcher slurm --partition gpu
  python sweep.py report --root runs/sweeps/pos_norm
"""
NAME = "pos_norm"
CONFIG = "configs/tiny.py"


def get_sweep():
  return {"model.pos_emb": ["none", "sinusoidal", "learned", "rope"],
          "model.norm_position": ["pre", "post"]}
