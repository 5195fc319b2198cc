"""Generate text from a megafab checkpoint (saved with any TP/PP/DP layout; runs on one process).

    megafab-generate --load checkpoints/gpt --prompt "Once upon a time" --max-new-tokens 64
    megafab-generate --load checkpoints/gpt --prompt-file prompt.txt --temperature 0.8 \\
        --top-p 0.9 --seed 1
    megafab-generate --load ck --prompt "5 17 3" --greedy --print-ids   # ids (no tokenizer)

Greedy with --greedy (or --temperature 0); otherwise sampling with --temperature, --top-k, --top-p.
Stops at the tokenizer's end-of-document token (or --eod). A KV cache makes each new token cost
one position; --no-kv-cache reruns the whole sequence every step (for comparison).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megafab.data.tokenizers import build_tokenizer
from megafab.inference import GenerationError, SamplingParams, generate, load_model
from megafab.run.report import exit_status

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="megafab checkpoint directory")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (token ids separated by spaces without a tokenizer)")
    src.add_argument("--prompt-file", help="file holding the prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k filtering")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus filtering")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--eod", type=int, default=None, help="stop token id (default: the tokenizer's)")
    p.add_argument("--no-kv-cache", action="store_true")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--print-ids", action="store_true", help="also print the generated token ids")
    return p.parse_args(argv)


def _tokenizer(cfg):
    d = cfg.data
    if d.tokenizer_type in (None, "NullTokenizer"):
        return None
    return build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                           trust_remote_code=d.trust_remote_code)


def _check_args(args) -> None:
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    if not args.greedy and args.temperature < 0:
        problems.append(f"--temperature {args.temperature} must be >= 0")
    if not 0.0 < args.top_p <= 1.0:
        problems.append(f"--top-p {args.top_p} must be in (0, 1]")
    if args.top_k < 0:
        problems.append(f"--top-k {args.top_k} must be >= 0")
    if problems:
        raise GenerationError("; ".join(problems))


def run(args) -> list[int]:
    _check_args(args)
    model, cfg = load_model(args.load, args.iteration, DTYPES[args.dtype], args.device)
    tokenizer = _tokenizer(cfg)
    text = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    if tokenizer is None:
        try:
            prompt = [int(t) for t in text.split()]
        except ValueError:
            raise GenerationError("the checkpoint has no tokenizer, so the prompt must be token ids "
                                  "separated by spaces") from None
    else:
        prompt = tokenizer.tokenize(text)
    eod = args.eod if args.eod is not None else (tokenizer.eod if tokenizer is not None else None)
    params = SamplingParams(args.max_new_tokens, 0.0 if args.greedy else args.temperature, args.top_k,
                            args.top_p, args.seed, eod)
    start = time.perf_counter()
    new = generate(model, prompt, params, use_kv_cache=not args.no_kv_cache)
    elapsed = time.perf_counter() - start
    print(tokenizer.detokenize(new) if tokenizer is not None else " ".join(map(str, new)))
    if args.print_ids:
        print("ids: " + " ".join(map(str, new)))
    print(f"[{len(prompt)} prompt tokens, {len(new)} new tokens in {elapsed:.3f} s]", file=sys.stderr)
    return new


def main(argv=None) -> int:
    def body():
        try:
            run(parse(argv))
        except OSError as e:  # e.g. an unreadable --prompt-file
            raise GenerationError(f"{e.filename or ''}: {e.strerror or e}") from None

    return exit_status(body)


if __name__ == "__main__":
    sys.exit(main())
