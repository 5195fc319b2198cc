"""Check an exported model: greedy continuations of megafab and of transformers must be identical.

    python tools/convert_checkpoint.py export-hf --load ckpt --hf-dir hf_out
    python tools/compare_hf_generation.py --load ckpt --hf-dir hf_out --prompt "KING HENRY."

Exit 0 when the token ids match, 1 when they differ, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from megafab.inference import SamplingParams, generate, load_model  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megafab checkpoint directory")
    p.add_argument("--hf-dir", required=True, help="the directory export-hf wrote")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    return p.parse_args(argv)


def hf_greedy(hf_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, local_files_only=True)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def main(argv=None) -> int:
    args = parse(argv)
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        print(f"compare: error: {args.hf_dir} has no config.json; run export-hf first", file=sys.stderr)
        return 2
    model, cfg = load_model(args.load, None, torch.float32, "cpu")
    from megafab.data.tokenizers import build_tokenizer

    d = cfg.data
    if d.tokenizer_type in (None, "NullTokenizer"):  # no tokenizer: the prompt is token ids
        tokenizer = None
        prompt = [int(t) for t in args.prompt.split()]
    else:
        tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                                    cfg.model.vocab_size)
        prompt = tokenizer.tokenize(args.prompt)
    # No EOD stop on either side, so both produce exactly max_new_tokens tokens.
    ours = generate(model, prompt, SamplingParams(args.max_new_tokens, 0.0, 0, 1.0, None, None))
    theirs = hf_greedy(args.hf_dir, prompt, args.max_new_tokens)
    show = tokenizer.detokenize if tokenizer is not None else (lambda ids: " ".join(map(str, ids)))
    print(f"megafab:      {show(ours)!r}")
    print(f"transformers: {show(theirs)!r}")
    same = ours == theirs
    print(f"greedy continuations of {len(ours)} tokens identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
