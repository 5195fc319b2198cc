"""Train a small SentencePiece (BPE) model on a jsonl corpus, for examples and tests.

    python tools/train_tokenizer.py --input data/english_train.jsonl --output-prefix data/english \\
        --vocab-size 4096
    -> data/english.model, for --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/english.model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


class TrainTokenizerError(Exception):
    pass


def iter_texts(path: str, key: str, max_chars: int):
    if not os.path.isfile(path):
        raise TrainTokenizerError(f"{path}: file not found")
    used = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise TrainTokenizerError(
                    f"{path}:{number}: not a JSON object with key {key!r} ({e})") from None
            for piece in text.split("\n"):
                if piece.strip():
                    yield piece
            used += len(text)
            if used >= max_chars:
                return


def train(input_path: str, output_prefix: str, vocab_size: int, json_key: str = "text",
          max_chars: int = 20_000_000) -> str:
    import sentencepiece

    if os.path.dirname(output_prefix):
        os.makedirs(os.path.dirname(output_prefix), exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter_texts(input_path, json_key, max_chars), model_prefix=output_prefix,
        vocab_size=vocab_size, model_type="bpe", character_coverage=1.0, byte_fallback=True,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, split_digits=True, num_threads=2,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
    return output_prefix + ".model"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="jsonl file, one document per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--max-chars", type=int, default=20_000_000, help="train on at most this much text")
    args = parser.parse_args(argv)
    start = time.time()
    try:
        if args.vocab_size < 300:
            raise TrainTokenizerError(f"--vocab-size {args.vocab_size} is too small: byte fallback alone "
                                      "needs 256 pieces; use 300 or more")
        model = train(args.input, args.output_prefix, args.vocab_size, args.json_key, args.max_chars)
    except TrainTokenizerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # sentencepiece reports bad settings (e.g. vocab too large) this way
        print(f"error: sentencepiece could not train on {args.input}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {model} (vocab {args.vocab_size}) in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
