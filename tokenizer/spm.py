"""Step 1 with SentencePiece: its BPE and the Unigram model the lesson names.

Training (`train_spm`) uses byte fallback (any string is representable, as in
byte-level BPE), identity normalisation, no dummy prefix, no removal of extra
spaces, and lets runs of spaces be tokens (indentation in code), so that
`decode(encode(s)) == s` holds exactly. The ids are 0 <pad>, 1 <unk>,
2 <bos>, 3 <eos>, 4 <mask>, then the 256 byte pieces, then the learned pieces.

SentencePiece writes a space as U+2581 ("▁") inside its pieces, so a literal
U+2581 in the text would come back as a space. `encode` therefore cuts the
text at each literal U+2581 and encodes the character itself as its three
UTF-8 byte pieces.

An existing `.model` file can be loaded as well (`load_spm_model`). Models
without a pad piece use <unk> as pad, and models without a <mask> control
piece use <unk> as mask; the round trip is exact only for models trained with
the settings above (byte fallback, identity normalisation, no dummy prefix).
"""
import os
import pathlib
import tempfile
from collections.abc import Iterable

import sentencepiece
from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2

from configs.errors import UserError
from tokenizer import base

KINDS = {"spm_bpe": "bpe", "spm_unigram": "unigram"}
MASK_PIECE = "<mask>"
NUM_SPECIALS = 5
MIN_VOCAB_SIZE = NUM_SPECIALS + 256
FILENAME = "spm.model"
_SPACE_SYMBOL = "\u2581"
_PIECE = sentencepiece_model_pb2.ModelProto.SentencePiece


class SentencePieceTokenizer(base.TableTokenizer):
  """Step 1: a SentencePiece model behind the common interface."""

  def __init__(self, model_proto: bytes, source: str):
    """Wraps a serialized model; `source` names it in error messages."""
    proto = sentencepiece_model_pb2.ModelProto()
    try:
      proto.ParseFromString(model_proto)
      processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    except (DecodeError, RuntimeError) as e:
      raise UserError(f"not a valid SentencePiece model: {source} "
                      f"({_one_line(e)})") from None
    model_type = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(
        proto.trainer_spec.model_type).lower()
    kinds = {model: kind for kind, model in KINDS.items()}
    if model_type not in kinds:
      raise UserError(f"{source}: SentencePiece model type {model_type} is not "
                      f"supported (only {', '.join(kinds)})")
    self.kind = kinds[model_type]
    if processor.bos_id() < 0 or processor.eos_id() < 0:
      raise UserError(f"{source}: the SentencePiece model has no bos or eos "
                      "piece; train it with bos_id and eos_id set")
    self._model_proto = model_proto
    self._processor = processor
    self._byte_fallback = proto.trainer_spec.byte_fallback
    self._strip_dummy_prefix = proto.normalizer_spec.add_dummy_prefix
    self._space_symbol_ids = [
        processor.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_SYMBOL.encode()]

    id_bytes = [_piece_bytes(piece) for piece in proto.pieces]
    unk_id = processor.unk_id()
    mask_ids = [i for i, piece in enumerate(proto.pieces)
                if piece.piece == MASK_PIECE and piece.type == _PIECE.CONTROL]
    pad_id = processor.pad_id() if processor.pad_id() >= 0 else unk_id
    mask_id = mask_ids[0] if mask_ids else unk_id
    fingerprint = base.fingerprint_of({
        "kind": self.kind,
        "pieces": [[p.piece, p.score, p.type] for p in proto.pieces],
        "specials": {"pad": pad_id, "unk": unk_id, "bos": processor.bos_id(),
                     "eos": processor.eos_id(), "mask": mask_id},
        "byte_fallback": self._byte_fallback,
        "normalizer": proto.normalizer_spec.SerializeToString(
            deterministic=True).hex(),
    })
    super().__init__(id_bytes, pad_id=pad_id, bos_id=processor.bos_id(),
                     eos_id=processor.eos_id(), mask_id=mask_id,
                     fingerprint=fingerprint)

  @property
  def model_proto(self) -> bytes:
    """The serialized SentencePiece model."""
    return self._model_proto

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; a literal U+2581 becomes its three byte pieces."""
    text = base.replace_surrogates(text)
    if not self._byte_fallback or _SPACE_SYMBOL not in text:
      return self._processor.encode(text)
    ids = []
    for i, part in enumerate(text.split(_SPACE_SYMBOL)):
      if i:
        ids += self._space_symbol_ids
      if part:
        ids += self._processor.encode(part)
    return ids

  def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
    """`encode` of each text; SentencePiece encodes the batch in threads."""
    texts = [base.replace_surrogates(text) for text in texts]
    batch = self._processor.encode(texts)
    for i, text in enumerate(texts):
      if self._byte_fallback and _SPACE_SYMBOL in text:
        batch[i] = self.encode(text)
    return batch

  def decode(self, ids: Iterable[int]) -> str:
    """As `Tokenizer.decode`; drops the space a dummy-prefix model adds."""
    text = super().decode(ids)
    if self._strip_dummy_prefix and text.startswith(" "):
      return text[1:]
    return text

  def _write_files(self, directory: pathlib.Path) -> None:
    (directory / FILENAME).write_bytes(self._model_proto)


def _piece_bytes(piece: _PIECE) -> bytes:
  """What one piece decodes to: its text with U+2581 as space, or its byte."""
  if piece.type == _PIECE.BYTE:
    return bytes([int(piece.piece[3:5], 16)])
  if piece.type == _PIECE.UNKNOWN:
    return "\ufffd".encode()
  if piece.type in (_PIECE.NORMAL, _PIECE.USER_DEFINED):
    return piece.piece.replace(_SPACE_SYMBOL, " ").encode()
  return b""


def _one_line(error: Exception) -> str:
  return " ".join(str(error).split())


def train_spm(kind: str, vocab_size: int,
              texts: Iterable[str]) -> SentencePieceTokenizer:
  """Step 1: trains SentencePiece BPE or Unigram on `texts` (one per line).

  The corpus and the model are written in a temporary directory that is
  removed afterwards; nothing is written elsewhere (`save` does that).
  """
  if kind not in KINDS:
    raise UserError(f"unknown SentencePiece kind {kind!r}; "
                    f"choose one of {', '.join(KINDS)}")
  if vocab_size < MIN_VOCAB_SIZE:
    raise UserError(f"{kind} vocabulary size {vocab_size} is too small: it "
                    f"needs 256 bytes + {NUM_SPECIALS} special tokens = "
                    f"{MIN_VOCAB_SIZE} at least")
  with tempfile.TemporaryDirectory(prefix="spm-train-") as tmp:
    corpus = pathlib.Path(tmp) / "corpus.txt"
    empty = True
    with open(corpus, "w", encoding="utf-8", newline="") as f:
      for text in texts:
        if text:
          empty = False
          f.write(base.replace_surrogates(text))
          f.write("" if text.endswith("\n") else "\n")
    if empty:
      raise UserError("the corpus is empty: no text to train SentencePiece on")
    prefix = os.path.join(tmp, "spm")
    try:
      sentencepiece.SentencePieceTrainer.train(
          input=str(corpus), model_prefix=prefix, model_type=KINDS[kind],
          vocab_size=vocab_size, byte_fallback=True,
          normalization_rule_name="identity", add_dummy_prefix=False,
          remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
          pad_id=0, unk_id=1, bos_id=2, eos_id=3, bos_piece="<bos>",
          eos_piece="<eos>", control_symbols=[MASK_PIECE], minloglevel=2)
    except RuntimeError as e:
      raise UserError(f"SentencePiece could not train a {kind} vocabulary of "
                      f"{vocab_size}: {_one_line(e)}") from None
    model_proto = pathlib.Path(prefix + ".model").read_bytes()
  return SentencePieceTokenizer(model_proto, f"trained {kind} model")


def load_spm_model(path: pathlib.Path) -> SentencePieceTokenizer:
  """Reads a SentencePiece `.model` file (UserError if missing or broken)."""
  try:
    model_proto = path.read_bytes()
  except OSError as e:
    raise UserError(f"cannot read the SentencePiece model {path}: "
                    f"{e.strerror}") from None
  return SentencePieceTokenizer(model_proto, str(path))
