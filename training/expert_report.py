"""A mixture of experts' routing in eval.py's report: how the validation
tokens spread over each MoE layer's experts (`model/moe.py`), and the plot
`expert_load.png`.

Per MoE layer: each expert's share of the (token, expert) assignments over
the evaluated batches (real tokens only, as in training's statistics), and
the load, the busiest expert's share over the mean (1 when balanced, E / k
when every token goes to the same k experts). A router that
collapses onto a few experts shows as a bright column in the plot.
"""
import jax
import numpy as np
from flax import nnx
from matplotlib.figure import Figure

from model.config import ModelConfig
from training.objectives import batch_loss


def expert_load(config, graphdef, params, batches) -> dict:
  """{"moe_layers", "expert_share" [layers][E], "expert_load" [layers]} of
  the model on `batches` (each batch weighs the same)."""

  @jax.jit
  def shares(p, batch):
    model = nnx.merge(graphdef, p)
    batch_loss(config.train.objective, model, batch)
    return model.decoder.router_stats.get_value().share  # [MoE layers, E]

  share_LE = np.mean([np.asarray(shares(params, b)) for b in batches], axis=0, dtype=np.float64)
  return {"moe_layers": list(ModelConfig.resolve(config.model).moe_layers),
          "expert_share": share_LE.round(6).tolist(),
          "expert_load": (share_LE.max(axis=1) / share_LE.mean(axis=1)).round(4).tolist()}


def plot_expert_load(path: str, report: dict, title: str) -> None:
  """expert_load.png: each MoE layer's experts (columns) coloured by their
  share of the assignments over the balanced share, 1/E; each row labelled
  with its load."""
  share_LE = np.asarray(report["expert_share"])
  layers, E = share_LE.shape
  fig = Figure(figsize=(max(4.0, 0.5 * E + 2.5), max(2.5, 0.35 * layers + 1.5)))
  ax = fig.subplots()
  image = ax.imshow(share_LE * E, aspect="auto", cmap="viridis", vmin=0)
  fig.colorbar(image, ax=ax, label="share of assignments / (1 / E)")
  ax.set_xticks(range(E))
  ax.set_yticks(range(layers))
  ax.set_yticklabels([f"layer {layer} (load {load:.2f})"
                      for layer, load in zip(report["moe_layers"], report["expert_load"])])
  ax.set_xlabel("expert")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
