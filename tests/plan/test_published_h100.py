"""The step-time model against Megatron-core's published H100 weak-scaling table (README,
images/model_table.png): H100 80GB, sequence 4096, vocabulary 131072, bf16, TP communication overlap
and data-parallel overlap (--overlap-grad-reduce, --overlap-param-gather) on.

Assumptions for the runs, where the README does not say (stated once, here):
  GPT with GELU and ffn 4h, untied embedding and output weights, learned positions (the parameter
  counts 1.7B..462B come out so), micro-batch 1, no activation recompute, the distributed optimizer,
  sequence parallel whenever TP > 1, 1F1B without virtual stages, flash attention, gradients reduced
  in bf16 (--grad-reduce-in-bf16: with fp32 reductions the TP-8 rows' data-parallel reduce-scatter,
  one 400 Gb/s NIC per rank, cannot hide behind one micro-batch's backward: with fp32 reductions
  the four rows of the issue stay within 7-9% (1.7B 1.09, 16B 0.98, 70B 0.93, 314B 0.97) but the
  32B row is predicted 23% slow).
"""

import pytest

from megafab.plan.machines import machine
from megafab.plan.search import candidate_from_flags, search

# model, heads, hidden, layers, TP, PP, DP, batch, published TFLOP/s per GPU
ROWS = [("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9)]
REQUIRED = ("1.7B", "16B", "70B", "314B")  # issue 25's four rows; the other five are held the same way
RANK_WITHIN = 10  # issue 25: the search ranks each published grid in its top 10


def model_flags(heads, hidden, layers, batch):
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "4096", "--vocab-size", "131072", "--global-batch-size", str(batch), "--bf16",
            "--untie-embeddings-and-output-weights", "--overlap-grad-reduce", "--overlap-param-gather",
            "--grad-reduce-in-bf16"]


def published_flags(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--micro-batch-size", "1", "--use-distributed-optimizer"] \
        + (["--sequence-parallel"] if tp > 1 else [])


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_published_layout_predicted_within_15_percent_and_fits(row):
    name, heads, hidden, layers, tp, pp, dp, batch, published = row
    h100 = machine("h100-sxm-80gb")
    cand = candidate_from_flags(model_flags(heads, hidden, layers, batch) + published_flags(tp, pp),
                                tp * pp * dp, h100, tp_comm_overlap=True)
    assert abs(cand.prediction.tflops_per_gpu / published - 1) <= 0.15, (name, cand.prediction)
    assert cand.memory_gib * 2**30 <= 80e9, (name, cand.memory_gib)
    assert cand.prediction.mfu == pytest.approx(cand.prediction.tflops_per_gpu / 989.0)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r[0] in REQUIRED], ids=list(REQUIRED))
def test_search_ranks_the_published_layout_in_its_top_10(row):
    name, heads, hidden, layers, tp, pp, dp, batch, _ = row
    h100 = machine("h100-sxm-80gb")
    gpus = tp * pp * dp
    flags = model_flags(heads, hidden, layers, batch)
    result = search(flags, gpus, h100, top=RANK_WITHIN, tp_comm_overlap=True, micro_batch_sizes=(1, 2))
    layouts = [(c.tp, c.pp, c.dp, c.cp) for c in result.ranked]
    assert (tp, pp, dp, 1) in layouts, (name, layouts)
    given = candidate_from_flags(flags + published_flags(tp, pp), gpus, h100, tp_comm_overlap=True)
    assert result.ranked[0].prediction.step_time_s <= given.prediction.step_time_s
    assert all(c.memory_gib <= h100.device_memory_gib for c in result.ranked)
