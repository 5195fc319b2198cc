"""Convert between HuggingFace transformers models and megafab checkpoints (GPT-2 and Llama).

    # HF directory -> megafab checkpoint; then: pretrain_gpt.py --load megafab_ckpt --finetune ...
    megafab-convert import-hf --hf-dir llama_hf --save megafab_ckpt \\
        --tensor-model-parallel-size 2 --make-vocab-size-divisible-by 128

    # megafab checkpoint saved with any TP/PP/DP layout -> HF directory (config.json,
    # model.safetensors, tokenizer files when the tokenizer is HF, SentencePiece or GPT-2 BPE)
    megafab-convert export-hf --load checkpoints/gpt --hf-dir gpt_hf

The imported vocabulary is padded as training pads it: to a multiple of
--make-vocab-size-divisible-by x --tensor-model-parallel-size; pass the values training will use.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megafab.checkpoint import CheckpointError
from megafab.config import ConfigError
from megafab.convert import ConversionError, export_hf, import_hf, read_checkpoint, write_checkpoint
from megafab.data.errors import DataError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-hf", help="HF model directory -> megafab checkpoint", allow_abbrev=False)
    imp.add_argument("--hf-dir", required=True, help="directory written by save_pretrained")
    imp.add_argument("--save", required=True, help="megafab checkpoint directory to write")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="TP size training will use (sets the vocabulary padding)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    imp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as stored")
    exp = sub.add_parser("export-hf", help="megafab checkpoint -> HF model directory", allow_abbrev=False)
    exp.add_argument("--load", required=True, help="megafab checkpoint directory (the --save of training)")
    exp.add_argument("--iteration", type=int, default=None, help="default: the latest")
    exp.add_argument("--hf-dir", required=True, help="directory to write")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as stored")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.command == "import-hf":
            sd, cfg = import_hf(args.hf_dir, args.tensor_model_parallel_size,
                                args.make_vocab_size_divisible_by, dtype)
            path = write_checkpoint(args.save, sd, cfg)
            print(f"imported {args.hf_dir} ({sum(t.numel() for t in sd.values()):,} parameters, vocabulary "
                  f"{cfg.model.vocab_size} padded to {cfg.model.padded_vocab_size}) into {path}; continue "
                  f"with pretrain_gpt.py --load {args.save} --finetune")
        else:
            sd, cfg = read_checkpoint(args.load, args.iteration)
            arch = export_hf(sd, cfg, args.hf_dir, dtype)
            print(f"exported {args.load} as {arch} to {args.hf_dir}")
    except (ConversionError, CheckpointError, ConfigError, DataError) as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
