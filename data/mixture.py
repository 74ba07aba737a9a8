"""Weighted mixtures of sources: `data.mixture` (docs/data.md, "Mixtures of sources").

A mixture is a list of sources, each read as a run with that `data.source`
and `data.paths` alone would read it: its own token cache, packing index,
train and validation splits. `sources(config)` gives each source's name,
weight and that config (`configs.validation.mixture_parts` parses and names
them).

Training interleaves the sources' endless train rows with Grain's
`MapDataset.mix` (`data/pipeline.py`): row g of the mixed stream is a fixed
function of g and the weights, each source's rows in their own shuffled
order (data.seed), so the stream is deterministic and a checkpoint's
iterator position resumes it exactly. The interleaving keeps every prefix of
the stream within a row of the weights per source (Grain rounds them to whole
parts, the smallest weight 100): it is not a random draw.
`Draws` says how many rows of each source the first n rows of the stream
hold, from the same `mix`, for the `tokens/<name>` metrics and the
start-up block.
"""
import contextlib
import dataclasses
import functools
import sys

import grain
from ml_collections import config_dict

from configs.errors import UserError
from configs.validation import MixturePart, mixture_parts


@dataclasses.dataclass(frozen=True)
class Source:
  """One source of a mixture: its name, its weight and the config that reads it alone."""
  name: str
  weight: float
  config: config_dict.ConfigDict  # the run's config with this data.source and data.paths


def alone(data_config: config_dict.ConfigDict, part: MixturePart) -> config_dict.ConfigDict:
  """A copy of the `data` section that reads `part` alone (no data.mixture)."""
  data = data_config.copy_and_resolve_references()
  data.update(source=part.source, paths=part.paths, mixture="")
  return data


def sources(config: config_dict.ConfigDict) -> list[Source]:
  """The sources of data.mixture, in order; [] when the run has no mixture."""
  out = []
  for part in mixture_parts(config.data):
    source_config = config.copy_and_resolve_references()
    source_config.data = alone(config.data, part)
    out.append(Source(part.name, part.weight, source_config))
  return out


@contextlib.contextmanager
def named(name: str):
  """A UserError raised while reading source `name` says which source it was."""
  try:
    yield
  except UserError as e:
    raise UserError(f"data.mixture source {name}: {e}") from None


def _tagged(source: int, key: int) -> tuple[int, int]:
  return source, key


class Draws:
  """How many rows of each source the first n rows of the mixed stream hold.

  The same `grain.MapDataset.mix` as the training stream, over each source's
  row numbers: row g of it is (source, k) where the training stream's row g
  is row k of that source. So the source's next row at or after n is its
  k-th, and k of its rows come before n. Finding one row of each source reads
  about (sum of weights) / (smallest weight) rows, at most
  `configs.validation.MAX_WEIGHT_RATIO` + 1.
  """

  def __init__(self, weights: dict[str, float]):
    """`weights`: each source's, by name, in the mixture's order."""
    self._names = list(weights)
    self._rows = grain.MapDataset.mix(
        [grain.MapDataset.range(sys.maxsize).map(functools.partial(_tagged, i))
         for i in range(len(weights))], list(weights.values()))

  def rows(self, n: int) -> dict[str, int]:
    """Rows of each source, by name, among rows [0, n) of the stream."""
    counts: list[int | None] = [None] * len(self._names)
    g = n
    while None in counts:
      source, key = self._rows[g]
      if counts[source] is None:
        counts[source] = key
      g += 1
    return dict(zip(self._names, counts))
