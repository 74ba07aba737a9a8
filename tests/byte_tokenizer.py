"""A stand-in for the tokenizer contract, in a module of its own so that
spawned tokenisation workers can unpickle it without importing the tests."""

PAD, BOS, EOS = 0, 1, 2


class ByteTokenizer:
  """UTF-8 bytes + 4; ids 0..3 special."""
  vocab_size = 260
  pad_id, bos_id, eos_id, mask_id = PAD, BOS, EOS, 3

  def __init__(self, fingerprint: str = "bytes-v1"):
    self.fingerprint = fingerprint
    self.encode_calls = 0

  def encode(self, text: str) -> list[int]:
    return [b + 4 for b in text.encode("utf-8")]

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    self.encode_calls += 1
    return [self.encode(t) for t in texts]

  def decode(self, ids: list[int]) -> str:
    return bytes(i - 4 for i in ids if i >= 4).decode("utf-8", errors="replace")
