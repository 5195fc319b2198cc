"""Convert checkpoints between megafab, Megatron-LM (torch_dist and legacy torch) and HuggingFace,
from any TP/PP/EP layout to any other; flags named as Megatron-LM's tools/checkpoint/convert.py.

    megafab-convert convert --load-dir checkpoints/gpt --save-dir gpt_torch \\
        --saver torch --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    megafab-convert convert --load-dir gpt_torch --save-dir gpt_hf --saver hf
    megafab-convert convert --hf-dir llama_hf --save-dir llama_dist --saver torch_dist \\
        --target-tensor-parallel-size 2 --make-vocab-size-divisible-by 128
    megafab-convert import-hf --hf-dir llama_hf --save megafab_ckpt      # shorthands
    megafab-convert export-hf --load checkpoints/gpt --hf-dir gpt_hf

The target layout is checked against the model before any tensor is read. Converted
checkpoints hold weights only: continue from them with --finetune (README: HuggingFace conversion).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megafab.checkpoint.formats import CKPT_FORMATS
from megafab.config import Config
from megafab.convert import export_hf, import_hf, read_checkpoint, write_checkpoint
from megafab.convert.checkpoint import open_checkpoint, target_config
from megafab.convert.hf_dir import ARCHITECTURES, read_hf_config
from megafab.convert.model_flags import write_model_flags
from megafab.convert.state_dict import finalize_model_config
from megafab.run.report import exit_status

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAVERS = (*CKPT_FORMATS, "hf")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="any checkpoint or HF directory -> any format", allow_abbrev=False)
    source = conv.add_mutually_exclusive_group(required=True)
    source.add_argument("--load-dir", help="checkpoint directory (the --save of a run; any format)")
    source.add_argument("--hf-dir", help="HF model directory written by save_pretrained")
    conv.add_argument("--iteration", type=int, default=None, help="default: the latest")
    conv.add_argument("--save-dir", required=True, help="directory to write")
    conv.add_argument("--saver", choices=SAVERS, default="torch_dist", help="output format")
    conv.add_argument("--target-tensor-parallel-size", type=int, default=None,
                      help="TP the output is laid out (legacy files) and vocab-padded for; default: the "
                           "input's")
    conv.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                      help="PP of legacy torch output (recorded in its args otherwise); default: the input's")
    conv.add_argument("--target-expert-parallel-size", type=int, default=None,
                      help="EP of legacy torch output's expert files (MoE models); default: the input's")
    conv.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="with --hf-dir")
    conv.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as stored")

    imp = sub.add_parser("import-hf", help="HF model directory -> torch_dist checkpoint", allow_abbrev=False)
    imp.add_argument("--hf-dir", required=True, help="directory written by save_pretrained")
    imp.add_argument("--save", required=True, help="checkpoint directory to write")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="TP size training will use (sets the vocabulary padding)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    imp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as stored")
    exp = sub.add_parser("export-hf", help="checkpoint -> HF model directory", allow_abbrev=False)
    exp.add_argument("--load", required=True, help="checkpoint directory (the --save of training)")
    exp.add_argument("--iteration", type=int, default=None, help="default: the latest")
    exp.add_argument("--hf-dir", required=True, help="directory to write")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as stored")
    args = parser.parse_args(argv)
    if args.command == "import-hf":  # the shorthands are conversions like any other
        args = argparse.Namespace(command="convert", load_dir=None, hf_dir=args.hf_dir, iteration=None,
                                  save_dir=args.save, saver="torch_dist",
                                  target_tensor_parallel_size=args.tensor_model_parallel_size,
                                  target_pipeline_parallel_size=None, target_expert_parallel_size=None,
                                  dtype=args.dtype,
                                  make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    elif args.command == "export-hf":
        args = argparse.Namespace(command="convert", load_dir=args.load, hf_dir=None,
                                  iteration=args.iteration, save_dir=args.hf_dir, saver="hf",
                                  target_tensor_parallel_size=None, target_pipeline_parallel_size=None,
                                  target_expert_parallel_size=None,
                                  dtype=args.dtype,
                                  make_vocab_size_divisible_by=128)
    return args


def _hf_config(hf_dir: str, tp: int, make_vocab_size_divisible_by: int) -> Config:
    """The Config import_hf gives a HF directory, from its config.json alone (no weights read)."""
    c = read_hf_config(hf_dir)
    flat = {**ARCHITECTURES[c["model_type"]].from_hf_config(c), "tensor_model_parallel_size": tp,
            "make_vocab_size_divisible_by": make_vocab_size_divisible_by}
    return dataclasses.replace(Config.from_flat(flat), model=finalize_model_config(flat, tp))


def convert(args) -> str:
    dtype = DTYPES[args.dtype] if args.dtype else None
    tp, pp, ep = args.target_tensor_parallel_size, args.target_pipeline_parallel_size, \
        args.target_expert_parallel_size
    opened = None
    if args.hf_dir:
        source_cfg = _hf_config(args.hf_dir, 1, args.make_vocab_size_divisible_by)  # padded again below
    else:
        opened = open_checkpoint(args.load_dir, args.iteration)
        source_cfg = opened[1]
    # every rule the target layout breaks, before a tensor is read (HF: one chunk, any layout)
    target_config(source_cfg, *((1, 1, 1) if args.saver == "hf" else (tp, pp, ep)))
    if args.hf_dir:
        sd, cfg = import_hf(args.hf_dir, tp or 1, args.make_vocab_size_divisible_by, dtype)
        what = f"{args.hf_dir} (HF {cfg.model.num_layers} layers)"
    else:
        sd, cfg = read_checkpoint(args.load_dir, args.iteration, opened)
        if dtype is not None:
            sd = {k: v.to(dtype) for k, v in sd.items()}
        what = args.load_dir
    if args.saver == "hf":
        arch = export_hf(sd, cfg, args.save_dir, dtype)
        return f"converted {what} to HF {arch} in {args.save_dir}"
    path = write_checkpoint(args.save_dir, sd, cfg, ckpt_format=args.saver, tp=tp, pp=pp, ep=ep)
    target = target_config(cfg, tp, pp, ep)  # what write_checkpoint recorded
    flags = write_model_flags(target, args.save_dir, args.hf_dir or args.load_dir)
    p = target.parallel
    return (f"converted {what} ({sum(t.numel() for t in sd.values()):,} parameters, vocabulary "
            f"{target.model.vocab_size} padded to {target.model.padded_vocab_size}) to {args.saver} for TP "
            f"{p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} in {path}; continue with "
            f"pretrain_gpt.py --config {flags} --load {args.save_dir} --finetune")


def main(argv=None) -> int:
    args = parse(argv)
    return exit_status(lambda: print(convert(args)))


if __name__ == "__main__":
    import sys

    sys.exit(main())
