"""Hugging Face checkpoints in and out.

  python convert.py from_hf --hf_dir DIR --workdir W [--pad_vocab_to_multiple N]  # step 0
  python convert.py to_hf --workdir W --out DIR [--step N]

`from_hf` writes a run that `python eval.py --workdir W` evaluates and
`python train.py --config configs/from_run.py:W --config.train.restore_from=W
--workdir W2` fine-tunes; `to_hf` writes a directory that
`transformers.AutoModelForCausalLM` (BERT: `AutoModelForMaskedLM`, T5 and BART:
`AutoModelForSeq2SeqLM`; a classifier: `AutoModelForSequenceClassification`)
and `AutoTokenizer` load. See
hf/convert.py and, for the architectures, hf/mappings.py.
"""
import argparse
import sys

from configs.errors import UserError


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  commands = parser.add_subparsers(dest="command", required=True)
  pull = commands.add_parser("from_hf", help="import a Hugging Face model directory")
  pull.add_argument("--hf_dir", required=True, help="config.json, safetensors, tokenizer files")
  pull.add_argument("--workdir", required=True, help="the new run directory")
  pull.add_argument("--fsdp", type=int, default=1, help="the run's mesh.fsdp (default 1)")
  pull.add_argument("--tensor", type=int, default=1, help="the run's mesh.tensor (default 1)")
  pull.add_argument("--pad_vocab_to_multiple", type=int, default=1,
                    help="pad the vocabulary rows to a multiple of N; their logits are masked "
                         "(model.real_vocab_size); default 1: the checkpoint's rows")
  pull.add_argument("--scan_layers", action=argparse.BooleanOptionalAction, default=None,
                    help="the run's model.scan_layers: layers stacked and scanned (also runs "
                         "of differing layers, as DeepSeek's dense then MoE) or a loop; "
                         "default: scanned unless the layers differ")
  push = commands.add_parser("to_hf", help="export a run as a Hugging Face model directory")
  push.add_argument("--workdir", required=True, help="the run directory")
  push.add_argument("--out", required=True, help="the new Hugging Face model directory")
  push.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  args = parser.parse_args(argv)
  from hf import convert as hf_convert  # pylint: disable=import-outside-toplevel
  try:
    if args.command == "from_hf":
      count = hf_convert.from_hf(args.hf_dir, args.workdir, fsdp=args.fsdp, tensor=args.tensor,
                                 pad_vocab_to_multiple=args.pad_vocab_to_multiple,
                                 scan_layers=args.scan_layers)
      print(f"wrote {args.workdir} (step 0, {count:,} parameters)")
    else:
      out = hf_convert.to_hf(args.workdir, args.out, args.step)
      print(f"wrote {out}")
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
