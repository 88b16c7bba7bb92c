"""The command line: `python -m mesh_tensorflow.transformer.convert to_hf|from_hf ...`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from mesh_tensorflow.transformer.convert.errors import ConversionError
from mesh_tensorflow.transformer.convert.reading_hf import from_hf
from mesh_tensorflow.transformer.convert.writing_hf import DTYPES, to_hf


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m mesh_tensorflow.transformer.convert",
                              description="Converts T5 checkpoints between Mesh TensorFlow and Hugging Face.")
  commands = p.add_subparsers(dest="command", required=True)
  out = commands.add_parser("to_hf", help="our model_dir -> a Hugging Face T5 directory")
  out.add_argument("--model_dir", required=True)
  out.add_argument("--output_dir", required=True)
  out.add_argument("--checkpoint_step", type=int, default=None, help="default: the latest checkpoint")
  out.add_argument("--gin_file", action="append", default=[], help="default: model_dir/operative_config.gin")
  out.add_argument("--gin_param", action="append", default=[], help="extra gin bindings")
  out.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
  out.add_argument("--overwrite", action="store_true")
  back = commands.add_parser("from_hf", help="a Hugging Face T5 directory -> our model_dir")
  back.add_argument("--hf_dir", required=True)
  back.add_argument("--model_dir", required=True)
  back.add_argument("--overwrite", action="store_true")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs one conversion; a refused input prints one line `error: ...` and returns 1."""
  args = parser().parse_args(argv)
  try:
    if args.command == "to_hf":
      summary = to_hf(args.model_dir, args.output_dir, checkpoint_step=args.checkpoint_step,
                      gin_files=args.gin_file, gin_bindings=args.gin_param, dtype=args.dtype,
                      overwrite=args.overwrite)
      print(f"wrote {summary['weights']} weights of {summary['checkpoint']} to {args.output_dir} "
            f"({', '.join(summary['files'])}); dropped {len(summary['dropped'])} optimizer slot and "
            "bookkeeping variables")
    else:
      summary = from_hf(args.hf_dir, args.model_dir, overwrite=args.overwrite)
      print(f"wrote {summary['weights']} variables of {args.hf_dir} to {summary['checkpoint']} and "
            f"{args.model_dir}/operative_config.gin")
  except ConversionError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0
