"""Step 1 with a Hugging Face tokenizer: a `tokenizer.json`, run by `tokenizers`.

A Hugging Face tokenizer directory holds `tokenizer.json` (the whole pipeline:
normalizer, pre-tokenizer, model -- byte-level BPE as GPT-2, Llama-3 and
Qwen2; SentencePiece-derived BPE or Unigram as Llama-2 and T5; WordPiece as
BERT --, post-processor, decoder) and usually `tokenizer_config.json` and
`special_tokens_map.json` (the special tokens by role). The `tokenizers`
library, the reference implementation, runs the pipeline; nothing of it is
rewritten here.

Special tokens are added as `transformers` (5.x) adds them:
- each role token (bos, eos, unk, sep, pad, cls, mask), each extra special
  token and each entry of `added_tokens_decoder` becomes an added token if the
  file does not already have it;
- the file's post-processor adds them around the text (Llama's BOS, BERT's
  [CLS]/[SEP], T5's </s>); `add_bos_token`/`add_eos_token` in the config are
  ignored when there is a `tokenizer.json`, as `transformers` 5 ignores them;
- `split_special_tokens` makes a special token's text in the input plain text.

`encode` gives the ids without special tokens (`add_special_tokens=False`),
`encode_with_specials` with them (`tokenizer(text)["input_ids"]`). Our ids
for the packer: bos is bos_token, else cls_token, else pad_token (T5's
decoder start); eos is eos_token, else sep_token; pad is pad_token, else eos;
mask is mask_token, else unk_token, else pad. `decode` skips special tokens
and applies no clean-up of spaces.

Unlike our own kinds, a special token's text in the input encodes to its id
(as in `transformers`), so `decode(encode(s)) == s` need not hold for such
text, nor for text a normalizer changes (BERT's lower-casing, accents).
"""
import json
import pathlib

import tokenizers

from configs.errors import UserError
from tokenizer import base

FILENAME = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
SUBDIR = "hf"  # where a saved `hf` tokenizer keeps its Hugging Face files
ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
         "cls_token", "mask_token")
_EXTRA_KEYS = ("additional_special_tokens", "extra_special_tokens")


def is_hf_tokenizer_json(content) -> bool:
  """Whether parsed `tokenizer.json` content is Hugging Face's (not our manifest)."""
  return isinstance(content, dict) and "model" in content and "kind" not in content


def _content(token) -> str | None:
  """The text of a special token written as a string or an AddedToken dict."""
  if isinstance(token, dict):
    return token.get("content")
  return token if isinstance(token, str) else None


class HFTokenizer(base.Tokenizer):
  """Step 1: a Hugging Face `tokenizer.json` behind the common interface."""

  kind = "hf"

  def __init__(self, tokenizer_json: str, config: dict, source: str):
    """`config`: tokenizer_config.json over special_tokens_map.json."""
    try:
      tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # pylint: disable=broad-except
      raise UserError(f"{source}: not a valid Hugging Face tokenizer.json "
                      f"({' '.join(str(e).split())})") from None
    self._json = tokenizer_json
    self._config = config
    roles = {role: _content(config.get(role)) for role in ROLES}
    extras = [_content(t) for key in _EXTRA_KEYS
              for t in (config.get(key) or []) if _content(t)]
    _add_missing_specials(tok, [t for t in roles.values() if t] + extras,
                          config.get("added_tokens_decoder") or {})
    tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
    self._tok = tok
    self._vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    ids = {role: tok.token_to_id(t) if t else None for role, t in roles.items()}
    eos = _first(ids, "eos_token", "sep_token")
    if eos is None:
      raise UserError(f"{source}: the tokenizer has no eos_token or sep_token; name one in "
                      f"{CONFIG_FILE}")
    pad = eos if ids["pad_token"] is None else ids["pad_token"]
    bos = _first(ids, "bos_token", "cls_token", "pad_token")
    mask = _first(ids, "mask_token", "unk_token")
    fingerprint = base.fingerprint_of({
        "kind": self.kind, "tokenizer": json.loads(tokenizer_json),
        "roles": roles, "extras": extras, "split_special_tokens": tok.encode_special_tokens})
    super().__init__(pad_id=pad, bos_id=pad if bos is None else bos, eos_id=eos,
                     mask_id=pad if mask is None else mask, fingerprint=fingerprint)

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  def token_bytes(self, token_id: int) -> bytes:
    """The UTF-8 of what `token_id` decodes to alone (a part of a character: U+FFFD)."""
    return self.decode([token_id]).encode("utf-8")

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(base.replace_surrogates(text), add_special_tokens=False).ids

  def encode_with_specials(self, text: str) -> list[int]:
    return self._tok.encode(base.replace_surrogates(text), add_special_tokens=True).ids

  def encode_classified(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
    encoding = self._tok.encode(base.replace_surrogates(text),
                                None if pair is None else base.replace_surrogates(pair),
                                add_special_tokens=True)
    return encoding.ids, encoding.type_ids

  def encode_batch(self, texts) -> list[list[int]]:
    """`encode` of each text; `tokenizers` encodes the batch in threads."""
    batch = self._tok.encode_batch([base.replace_surrogates(t) for t in texts],
                                   add_special_tokens=False)
    return [encoding.ids for encoding in batch]

  def decode(self, ids) -> str:
    return self._tok.decode(self._check_ids(ids).tolist(), skip_special_tokens=True)

  def write_hf(self, directory: pathlib.Path) -> None:
    """Writes the Hugging Face files as loaded: tokenizer.json and the config."""
    (directory / FILENAME).write_text(self._json, encoding="utf-8")
    (directory / CONFIG_FILE).write_text(json.dumps(self._config, indent=2) + "\n",
                                         encoding="utf-8")

  def _write_files(self, directory: pathlib.Path) -> None:
    (directory / SUBDIR).mkdir()
    self.write_hf(directory / SUBDIR)


def _first(ids: dict, *roles: str) -> int | None:
  return next((ids[role] for role in roles if ids[role] is not None), None)


def _add_missing_specials(tok: tokenizers.Tokenizer, specials: list[str],
                          added_tokens_decoder: dict) -> None:
  """Adds the tokens transformers adds at load time that the file lacks."""
  present = {t.content for t in tok.get_added_tokens_decoder().values()}
  for entry in added_tokens_decoder.values():
    content = _content(entry)
    if content and content not in present:
      tok.add_tokens([tokenizers.AddedToken(
          content, single_word=entry.get("single_word", False), lstrip=entry.get("lstrip", False),
          rstrip=entry.get("rstrip", False), normalized=entry.get("normalized", False),
          special=entry.get("special", False))])
      present.add(content)
  missing = [t for t in dict.fromkeys(specials) if t not in present]
  if missing:
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in missing])


def read_config(directory: pathlib.Path) -> dict:
  """tokenizer_config.json over special_tokens_map.json ({} where absent)."""
  config = {}
  for name in (SPECIAL_TOKENS_FILE, CONFIG_FILE):
    path = directory / name
    if path.is_file():
      try:
        content = json.loads(path.read_text(encoding="utf-8"))
      except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {type(e).__name__}: {e}") from None
      if not isinstance(content, dict):
        raise UserError(f"{path} is not a JSON object")
      config.update(content)
  return config


def load_hf(directory: pathlib.Path) -> HFTokenizer:
  """Reads a Hugging Face tokenizer directory (tokenizer.json and its configs)."""
  path = directory / FILENAME
  try:
    tokenizer_json = path.read_text(encoding="utf-8")
  except OSError as e:
    raise UserError(f"cannot read the Hugging Face tokenizer {path}: {e.strerror}") from None
  return HFTokenizer(tokenizer_json, read_config(directory), str(path))
