"""BERT masking for the encoder's masked-LM objective (the lesson's "Three
families": encoder-only, bidirectional, masked-LM).

Each real, non-special token of a packed row is selected with probability p
(train.mlm_probability, 15% in BERT). A selected token becomes the mask token
with probability 0.8, a uniformly random non-special token with 0.1, and
stays unchanged with 0.1; the loss is on the selected positions only, whose
targets are the original tokens. Padding (segment 0) and special tokens (pad,
BOS, EOS, mask) are never selected.

The row comes from `data/packing.py` (its `inputs` are the row's tokens; the
shifted `targets` of next-token training are replaced). `random_map` is
called by Grain with a generator seeded by (seed, element index), so every
row is masked the same way on every run and after a resume, and differently
in each epoch.
"""
import grain
import numpy as np

MASK, RANDOM, KEEP = 0.8, 0.1, 0.1  # BERT's replacement of a selected token


class BertMasking(grain.transforms.RandomMap):
  """A packed row -> masked `inputs`, original `targets`, `loss_mask` on the selected."""

  def __init__(self, probability: float, *, vocab_size: int, mask_id: int,
               special_ids: tuple[int, ...]):
    self.probability = probability
    self.mask_id = mask_id
    self.special_ids = np.asarray(sorted(set(special_ids)), np.int32)
    self.replacement_ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int32),
                                        self.special_ids)  # [V - specials]

  def random_map(self, row: dict[str, np.ndarray], rng: np.random.Generator
                 ) -> dict[str, np.ndarray]:
    tokens_T = row["inputs"]
    candidates_T = (row["segment_ids"] > 0) & ~np.isin(tokens_T, self.special_ids)
    selected_T = candidates_T & (rng.random(tokens_T.shape) < self.probability)
    action_T = rng.random(tokens_T.shape)
    random_T = self.replacement_ids[rng.integers(len(self.replacement_ids),
                                                 size=tokens_T.shape)]
    inputs_T = np.where(selected_T & (action_T < MASK), self.mask_id, tokens_T)
    inputs_T = np.where(selected_T & (action_T >= MASK) & (action_T < MASK + RANDOM), random_T,
                        inputs_T)
    return {**row, "inputs": inputs_T.astype(np.int32), "targets": tokens_T,
            "loss_mask": selected_T.astype(np.float32)}


def for_tokenizer(probability: float, tokenizer) -> BertMasking:
  """The masking for `tokenizer`'s vocabulary and special ids."""
  return BertMasking(probability, vocab_size=tokenizer.vocab_size, mask_id=tokenizer.mask_id,
                     special_ids=(tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id,
                                  tokenizer.mask_id))
