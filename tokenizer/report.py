"""What text costs in tokens, Step 1's point: `python -m tokenizer.report DIR`.

The lesson: merges learned from a corpus make its common words single tokens,
while code, rare words and non-English text split into more pieces per word,
which raises their cost and eats context length. This report measures bytes
per token, characters per token and tokens per word (a word is a run of
non-space characters) on English prose (the pydoc topics of the validation
split), Python code (the standard-library files of the validation split) and
short German, Russian and Chinese samples. Chinese is written without spaces,
so its "words" are whole clauses: compare it by characters per token.
"""
import argparse
import sys
from collections.abc import Sequence

import tokenizer
from configs.errors import UserError
from data import corpora
from tokenizer import inputs

GERMAN = (
    "Der Zug nach Hamburg hatte wieder einmal Verspätung, und auf dem "
    "Bahnsteig standen die Reisenden dicht gedrängt unter dem schmalen Dach. "
    "Eine ältere Frau erzählte ihrem Nachbarn von ihrer Enkelin, die gerade "
    "ein Studium der Meeresbiologie begonnen hatte und im Sommer auf einem "
    "Forschungsschiff arbeiten wollte. Als endlich die Durchsage kam, dass der "
    "Zug in wenigen Minuten einfahren würde, griffen alle gleichzeitig nach "
    "ihren Koffern.\n\n"
    "Zusammengesetzte Wörter wie Rechtsschutzversicherungsbedingungen oder "
    "Kühlschranktürgriff kommen in den Trainingstexten selten vor, deshalb "
    "zerfallen sie beim Zerlegen in viele kleine Stücke.\n")

RUSSIAN = (
    "Вечером над рекой поднялся туман, и рыбаки один за другим потянулись к "
    "берегу. Старик Пётр медленно сматывал удочки и рассказывал мальчишкам, "
    "как сорок лет назад поймал щуку длиннее собственной руки. Никто ему, "
    "конечно, не верил, но слушали все внимательно, потому что рассказывать "
    "он умел лучше всех в деревне.\n\n"
    "Зимой дорога до ближайшего города занимает почти три часа, а летом её "
    "можно проехать за полтора.\n")

CHINESE = (
    "今天早上下了一场大雨，街上的行人都撑着伞匆匆走过。我在路边的小店里买了一杯"
    "热豆浆和两个包子，一边吃一边看着窗外的车流。老板告诉我，这家店已经开了二十多"
    "年，很多老顾客每天都会来这里吃早饭。\n\n"
    "学习一门新的语言需要耐心，每天坚持读一点、写一点，慢慢就会发现自己进步了。\n")


def samples() -> list[tuple[str, str]]:
  """(name, text) of each sample the report measures."""
  prose = corpora.split(corpora.pydoc_documents(), "validation",
                        inputs.VAL_PERCENT)
  code = corpora.split(corpora.stdlib_documents(), "validation",
                       inputs.VAL_PERCENT)
  return [
      ("English prose (pydoc validation)", "\n".join(t for _, t in prose)),
      ("Python code (stdlib validation)", "\n".join(t for _, t in code)),
      ("German", GERMAN),
      ("Russian", RUSSIAN),
      ("Chinese", CHINESE),
  ]


def measure(tok: tokenizer.Tokenizer, text: str) -> dict[str, float]:
  """Sizes of `text` and what it costs in `tok`'s tokens."""
  num_bytes = len(text.encode("utf-8"))
  num_tokens = len(tok.encode(text))
  num_words = len(text.split())
  return {
      "bytes": num_bytes,
      "chars": len(text),
      "words": num_words,
      "tokens": num_tokens,
      "bytes_per_token": num_bytes / max(num_tokens, 1),
      "chars_per_token": len(text) / max(num_tokens, 1),
      "tokens_per_word": num_tokens / max(num_words, 1),
  }


def format_table(rows: list[tuple[str, dict[str, float]]]) -> str:
  """A markdown table of `measure` results, one row per sample."""
  lines = ["| sample | bytes | tokens | bytes/token | chars/token | "
           "tokens/word |",
           "|---|---:|---:|---:|---:|---:|"]
  for name, m in rows:
    lines.append(f"| {name} | {m['bytes']:,} | {m['tokens']:,} | "
                 f"{m['bytes_per_token']:.2f} | {m['chars_per_token']:.2f} | "
                 f"{m['tokens_per_word']:.2f} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m tokenizer.report",
      description="Tokens per word and bytes per token of a saved tokenizer "
      "on English prose, Python code and non-English text.")
  parser.add_argument("path", help="saved tokenizer directory or .model file")
  args = parser.parse_args(argv)
  try:
    tok = tokenizer.load_tokenizer(args.path)
  except UserError as e:
    print(f"error: {e}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)
  print(f"{tok.kind} tokenizer {tok.fingerprint[:12]}, {tok.vocab_size} ids\n")
  print(format_table([(name, measure(tok, text)) for name, text in samples()]))
  print("\nA word is a run of non-space characters; Chinese has no spaces, so "
        "compare it by chars/token.")


if __name__ == "__main__":
  main()
