"""Megatron's tools/preprocess_data.py, as megafab implements it (megafab/data/preprocess/cli.py).

    python tools/preprocess_data.py --input data.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megafab.data.preprocess.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
