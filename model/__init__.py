"""Flax NNX transformer modules: `build_model(config, rngs)` -> the family's module."""
from flax import nnx

from configs.validation import validate_model
from model.transformer import Decoder, Encoder, EncoderDecoder

FAMILIES = {"decoder": Decoder, "encoder": Encoder, "encoder_decoder": EncoderDecoder}


def build_model(model_config, rngs: nnx.Rngs, *, remat: bool = False) -> nnx.Module:
  """Validates `model_config` (the `model` section) and builds its family.

  `remat=True` recomputes each block's activations in the backward pass.
  """
  validate_model(model_config)
  return FAMILIES[model_config.family](model_config, rngs=rngs, remat=remat)
