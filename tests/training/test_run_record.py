"""The record of a run (PP 2 on 2 gloo ranks): the start-up summary, metrics.jsonl line for line
with the iteration lines, the memory line, the timers, Megatron's TensorBoard tags every
--tensorboard-log-interval, and the resolved configuration, which --config reads back."""

import json
import re

import pytest

from megafab.arguments import config_from_args
from tests.helpers.flags import tiny_flags
from tests.helpers.launch import pretrain_in_ranks

FLAGS = tiny_flags(num_layers=2) + [
    "--micro-batch-size", "1", "--global-batch-size", "4", "--num-workers", "0", "--mock-data",
    "--vocab-size", "127", "--make-vocab-size-divisible-by", "32", "--lr", "1e-2",
    "--pipeline-model-parallel-size", "2", "--train-iters", "4", "--log-interval", "2",
    "--tensorboard-log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--timing-log-level", "2",
    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"]

# " [time] iteration N/ T | key: value | ... |": the fields after the iteration count.
FIELDS = re.compile(r"\| ([^|:]+): ([^|]+?) (?=\|)")


@pytest.fixture(scope="module")
def run(tmp_path_factory, mock_data_cache):
    save = tmp_path_factory.mktemp("run")
    flags = FLAGS + mock_data_cache + ["--save", str(save), "--tensorboard-dir", str(save / "tb")]
    first, last = pretrain_in_ranks(flags, world_size=2)
    return save, flags, first, last


def test_start_up_summary_on_rank_0(run):
    _, _, first, _ = run
    assert "using world size: 2, data-parallel size: 1, tensor-model-parallel size: 1, " \
           "pipeline-model-parallel size: 2" in first
    args = first.split("------------------------ arguments ------------------------\n")[1]
    args = args.split("-------------------- end of arguments ---------------------")[0]
    assert re.search(r"^  num_layers \.+ 2$", args, re.M)
    assert re.search(r"^  padded_vocab_size \.+ 128$", args, re.M)
    stages = re.findall(r"number of parameters on \(tensor, pipeline\) model parallel rank \(0, (\d)\): "
                        r"(\d+)", first)
    assert [s for s, _ in stages] == ["0", "1"]
    # stage 0: word + position embeddings and layer 0; stage 1: layer 1, final norm, tied output layer
    layer = 4 * 32 * 32 + 4 * 32 + 2 * (4 * 32 * 32) + 4 * 32 + 32  # qkv, proj, fc1, fc2 and their biases
    layer += 2 * 2 * 32  # two LayerNorms
    assert int(stages[0][1]) == 128 * 32 + 16 * 32 + layer
    assert int(stages[1][1]) == layer + 2 * 32 + 128 * 32
    assert re.search(r"datasets target sizes \(minimum size\):\n    train:      16\n    validation: 12\n"
                     r"    test:       4", first)


def test_metrics_jsonl_matches_the_iteration_and_validation_lines(run):
    save, _, _, last = run
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    texts = [line for line in last.splitlines() if " iteration " in line and "/" in line.split("|")[0]
             or line.startswith((" validation loss at", " test loss at"))]
    # iterations 1 (the run's first, as Megatron 0.16), 2 and 4; validation after 2, 4 and at the
    # end; test at the end
    assert [r["kind"] for r in records] == ["iteration", "iteration", "validation", "iteration",
                                            "validation", "validation", "test"]
    assert [r["iteration"] for r in records if r["kind"] == "iteration"] == [1, 2, 4]
    assert len(texts) == len(records)
    for record, text in zip(records, texts):
        if record["kind"] == "iteration":
            head = re.match(r" \[(.+?)\] iteration\s+(\d+)/\s*(\d+) ", text)
            assert (head.group(1), int(head.group(2)), int(head.group(3))) == \
                (record["time"], record["iteration"], record["train_iters"])
            fields = dict(FIELDS.findall(text))
            assert int(fields["consumed samples"]) == record["consumed_samples"]
            assert fields["lm loss"] == f"{record['lm loss']:.6E}"
            assert fields["learning rate"] == f"{record['lr']:.6E}"
            assert fields["grad norm"] == f"{record['grad_norm']:.3f}"
            assert fields["elapsed time per iteration (ms)"] == f"{record['elapsed_ms']:.1f}"
            assert re.fullmatch(r"\d+:\d\d:\d\d", fields["ETA"])
        else:
            value, ppl = record["lm loss"], record["lm loss PPL"]
            assert f"lm loss value: {value:.6E} | lm loss PPL: {ppl:.6E}" in text
            assert text.startswith(f" {record['kind']} loss at {record['where']} |")


def test_memory_line_and_timers(run):
    _, _, first, last = run
    # after the logged iterations 1 and 2, not after 4: Megatron stops after the second iteration
    assert re.findall(r"\[Rank 0\] \(after (\d+) iterations\) memory \(MB\) \| resident: [\d.]+ \| "
                      r"max resident: [\d.]+", first) == ["1", "2"]
    blocks = re.findall(r"\(min, max\) time across ranks \(ms\):\n((?:    .*\n)+)", last)
    assert len(blocks) == 3  # one per logged iteration
    timed = dict(re.findall(r"    (\S+) \.+: \(([\d.]+), [\d.]+\)", blocks[0]))
    for name in ("forward-backward", "all-grads-sync", "optimizer", "forward-compute", "backward-compute",
                 "batch-generator", "forward-send", "forward-recv", "backward-send", "backward-recv"):
        assert float(timed[name]) > 0, (name, blocks[0])


def test_tensorboard_tags_every_tensorboard_log_interval(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save = run[0]
    events = EventAccumulator(str(save / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "batch-size", "grad-norm", "loss-scale",
            "lm loss validation", "lm loss validation vs samples", "lm loss validation ppl",
            "iteration-time", "forward-backward-time"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]  # --log-interval is 2
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [4, 8, 12, 16]
    assert [e.step for e in events.Scalars("forward-backward-time")] == [2, 4]
    # Megatron's total_loss_dict: a line's lm loss is the mean over its window's iterations (1 | 1-2 | 3-4)
    per_step = [e.value for e in events.Scalars("lm loss")]
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    logged = [r["lm loss"] for r in records if r["kind"] == "iteration"]
    expected = [per_step[0], (per_step[0] + per_step[1]) / 2, (per_step[2] + per_step[3]) / 2]
    assert logged == pytest.approx(expected, rel=1e-6)  # TensorBoard holds float32
    assert per_step[1] != pytest.approx(logged[1], rel=1e-6)  # the window mean is not the last step's


def test_resolved_config_reads_back_to_the_same_configuration(run):
    save, flags, first, _ = run
    path = save / "resolved_config.toml"
    assert f"resolved configuration written to {path}" in first
    again = config_from_args(["--config", str(path)], world_size=2)
    expected = config_from_args(flags, world_size=2, start_up=True)  # sized from its tokenizer, as the run
    assert again.to_flat() == expected.to_flat()
    assert "\npadded_vocab_size = 128\n" in path.read_text()  # written out, as --padded-vocab-size
