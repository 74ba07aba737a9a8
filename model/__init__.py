"""Flax NNX transformer modules: `build_model(config, rngs)` -> the family's module."""
from flax import nnx

from model.config import ModelConfig
from model.transformer import Decoder, Encoder, EncoderDecoder

FAMILIES = {"decoder": Decoder, "encoder": Encoder, "encoder_decoder": EncoderDecoder}


def build_model(model_config, rngs: nnx.Rngs, *, remat: bool | str = False,
                mtp_depth: int = 0) -> nnx.Module:
  """Builds the family of `model_config` (the `model` ConfigDict section,
  validated and resolved by `ModelConfig.resolve`, or a `ModelConfig`).

  `remat` (train.remat: a policy name of model/remat.py, or True for `full`,
  False for `none`) is what each block recomputes in the backward pass;
  `mtp_depth` (train.mtp_depth, decoders only) adds that many multi-token
  prediction modules (`model/mtp.py`).
  """
  cfg = ModelConfig.resolve(model_config)
  if mtp_depth:
    return FAMILIES[cfg.family](cfg, rngs=rngs, remat=remat, mtp_depth=mtp_depth)
  return FAMILIES[cfg.family](cfg, rngs=rngs, remat=remat)
