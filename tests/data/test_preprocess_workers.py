"""--workers N: the ordered pool (order, bounded window, errors, a killed worker), the spans workers
read, and output bytes that do not depend on --workers or --block-mb."""

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from megafab.data.errors import DataError
from megafab.data.preprocess import cli
from megafab.data.preprocess.blocks import cut_spans
from megafab.data.preprocess.ordered_pool import ordered_map
from tests.helpers.preprocess import TOKENIZERS

GPT2 = TOKENIZERS["gpt2"]


def _slow_square(x):
    time.sleep(random.random() * 0.005)
    return x * x, os.getpid()


def test_ordered_map_keeps_order_uses_every_process_and_bounds_the_window():
    pulled = []

    def items():
        for i in range(60):
            pulled.append(i)
            yield i

    out = []
    for square, pid in ordered_map(_slow_square, items(), workers=3, depth=5):
        assert len(pulled) - len(out) <= 5  # never more than depth handed out and not yet yielded
        out.append((square, pid))
    assert [s for s, _ in out] == [i * i for i in range(60)]
    pids = {pid for _, pid in out}
    assert os.getpid() in pids and len(pids) == 3  # this process and both forked workers tokenized


def _data_error(x):
    raise DataError(f"item {x} is bad")


def _key_error(x):
    raise KeyError(x)


def test_worker_errors_reach_the_caller():
    # The first items always go to the forked workers; this process would pass its own through.
    with pytest.raises(DataError, match="item 0 is bad"):
        list(ordered_map(_data_error, range(20), workers=2, local_fn=lambda x: x))
    with pytest.raises(RuntimeError, match="KeyError: 0"):
        list(ordered_map(_key_error, range(20), workers=2, local_fn=lambda x: x))


def _kill_self(x):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_is_an_error_not_a_hang():
    start = time.time()
    with pytest.raises(DataError, match=r"died with exit code -9 .*fewer --workers"):
        list(ordered_map(_kill_self, range(10), workers=2, local_fn=lambda x: x))
    assert time.time() - start < 30


def test_spans_start_at_line_starts_cover_the_file_and_shrink_at_the_end(tmp_path):
    path = tmp_path / "lines.jsonl"
    rng = random.Random(0)
    path.write_bytes(b"".join(b"x" * rng.randrange(1, 300) + b"\n" for _ in range(40_000)))  # 6 MB
    data = path.read_bytes()
    block = 1 << 20
    for workers in (1, 2, 4):
        spans = cut_spans(str(path), block, workers)
        assert spans[0][0] == 0 and spans[-1][1] == len(data)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(data[start - 1 : start] == b"\n" for start, _ in spans[1:])
        sizes = [end - start for start, end in spans]
        if workers == 1:
            assert min(sizes[:-1]) >= block
        else:  # the last spans shrink so that the processes finish together
            assert max(sizes) < block + 300 and max(sizes[-3:]) < block / 2


def write_corpus(path: Path, documents: int = 400) -> Path:
    rng = random.Random(1)
    words = ["the", "data", "héllo", "token", "12345", "<|endoftext|>", "wörld", "\r\n", "  ", "日本"]
    lines = []
    for i in range(documents):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(0, 80)))
        lines.append(json.dumps({"text": text if i % 37 else ""}))
        if i % 50 == 3:
            lines.append(lines[-1])  # an exact duplicate for --dedup
        if i % 90 == 5:
            lines.append("")  # a blank line: skipped
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run(tmp_path, name, *extra):
    prefix = tmp_path / name
    argv = ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(prefix), *GPT2, "--append-eod"]
    assert cli.main([*argv, *extra]) == 0
    return b"".join(Path(f"{prefix}_text_document.{ext}").read_bytes() for ext in ("bin", "idx"))


@pytest.mark.parametrize("cleaning", [[], ["--dedup"]])
def test_output_bytes_do_not_depend_on_workers_or_block_size(tmp_path, cleaning):
    write_corpus(tmp_path / "c.jsonl")
    one = run(tmp_path, "w1", "--workers", "1", *cleaning)
    assert run(tmp_path, "w2", "--workers", "2", "--block-mb", "0.003", *cleaning) == one
    assert run(tmp_path, "w3", "--workers", "3", "--block-mb", "0.01", *cleaning) == one
    assert not [p for p in os.listdir(tmp_path) if "_parts_" in p]  # part files removed


def test_a_bad_line_in_a_later_span_names_its_line_in_the_file(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl")
    lines = corpus.read_text(encoding="utf-8").split("\n")
    lines[300] = '{"text": "unterminated'
    corpus.write_text("\n".join(lines), encoding="utf-8")
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), *GPT2, "--workers", "2"]
    assert cli.main([*argv, "--block-mb", "0.003"]) == 2
    assert f"{corpus}:301: malformed JSON" in capsys.readouterr().err
    assert not [p for p in os.listdir(tmp_path) if p != "c.jsonl"]  # no outputs, no part files left
