"""The checkpoint layout without processes: flat ranges as boxes, TP blocks in the stored view,
and the boxes every (TP, DP) rank writes tiling each stored tensor exactly once."""

import math
import random

import pytest
import torch

from megafab.checkpoint.boxes import Box, flat_range_boxes
from megafab.checkpoint.layout import WORD_EMBEDDING, from_stored, param_layout, to_stored
from megafab.checkpoint.state import write_plan
from megafab.distributed.data_parallel import owned_ranges, plan_buckets
from megafab.distributed.layers import partition_of
from megafab.model.gpt import build_model_chunks
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, context, tiny_config


def _index(box: Box):
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))


def test_flat_range_boxes_cover_the_range_once_in_order_as_contiguous_views():
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        flat_ids = torch.arange(n).view(shape) if shape else torch.tensor(0)
        boxes = flat_range_boxes(shape, lo, hi)
        assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, lo, hi, boxes)
        position = lo
        for start, box in boxes:
            assert start == position  # in flat order, no gaps
            covered = flat_ids[_index(box)].reshape(-1)
            assert torch.equal(covered, torch.arange(start, start + box.numel))  # contiguous
            position += box.numel
        assert position == hi, (shape, lo, hi, boxes)


def test_a_range_on_row_boundaries_is_one_box():
    assert flat_range_boxes((4, 3, 2), 6, 18) == [(6, Box((1, 0, 0), (2, 3, 2)))]
    assert flat_range_boxes((4, 3, 2), 7, 7) == []
    # partial first row (itself a partial row + full rows), full rows, partial last row
    assert [b for _, b in flat_range_boxes((4, 3, 2), 1, 23)] == [
        Box((0, 0, 1), (1, 1, 1)), Box((0, 1, 0), (1, 2, 2)), Box((1, 0, 0), (2, 3, 2)),
        Box((3, 0, 0), (1, 2, 2)), Box((3, 2, 0), (1, 1, 1))]


def _tp_param(full, dim, stride, rank, tp):
    p = torch.nn.Parameter(partition_of(full, dim, rank, tp, stride))
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


def test_stride_two_blocks_are_rectangles_of_the_gate_up_view():
    ffn, h, tp = 6, 4, 3
    full = torch.arange(2 * ffn * h, dtype=torch.float64).view(2 * ffn, h)  # [gate; up]
    rebuilt = torch.zeros(2, ffn, h, dtype=torch.float64)
    for r in range(tp):
        p = _tp_param(full, 0, 2, r, tp)  # [gate_r; up_r]
        layout = param_layout("decoder.layers.0.mlp.linear_fc1.weight", p, tp, r)
        assert layout.global_shape == (2, ffn, h) and layout.block_offsets == (0, r * ffn // tp, 0)
        shard = layout.whole(p.detach())
        assert len(shard.boxes) == 1
        rebuilt[_index(shard.boxes[0])] = shard.views[0]
        # a flat slice of the rank's [gate_r; up_r] lands where it belongs in the view
        part = layout.shard(p.detach().view(-1)[5:13], 5, 13)
        for box, view in zip(part.boxes, part.views):
            assert torch.equal(view, full.view(2, ffn, h)[_index(box)])
            assert view.data_ptr() >= p.data_ptr()  # a view, not a copy
    assert torch.equal(rebuilt, full.view(2, ffn, h))


def test_row_parallel_and_replicated_blocks():
    p = _tp_param(torch.zeros(5, 12), 1, 1, 2, 4)
    layout = param_layout("w", p, 4, 2)
    assert (layout.global_shape, layout.block_offsets, layout.replica) == ((5, 12), (0, 6), False)
    q = torch.nn.Parameter(torch.zeros(7))
    assert param_layout("b", q, 4, 0).replica is False and param_layout("b", q, 4, 3).replica is True
    assert param_layout("b", q, 4, 3).global_shape == (7,)


def test_full_tensors_use_the_same_strided_view():
    cfg = tiny_config(style=LLAMA_STYLE).model
    fc1 = torch.randn(2 * cfg.ffn_hidden_size, cfg.hidden_size)
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    assert to_stored(name, fc1, cfg).shape == (2, cfg.ffn_hidden_size, cfg.hidden_size)
    assert torch.equal(from_stored(name, to_stored(name, fc1, cfg), cfg), fc1)
    assert to_stored(WORD_EMBEDDING, fc1, cfg).shape == fc1.shape


def _rank_params(full_named, tp, tp_rank):
    """This TP rank's parameters (local shapes, megafab's TP attributes) without a process group."""
    out = []
    for name, p in full_named:
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] //= tp
        q = torch.nn.Parameter(torch.empty(shape))
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared_embedding"):
            if hasattr(p, attr):
                setattr(q, attr, getattr(p, attr))
        out.append((name, q))
    return out


@pytest.mark.parametrize("style,pp,dist_opt", [(LLAMA_STYLE, 1, True), (GPT2_STYLE, 2, True),
                                               (GPT2_STYLE, 1, False)])
def test_the_boxes_every_rank_writes_tile_every_stored_tensor_exactly_once(style, pp, dist_opt):
    """SwiGLU (stride 2), tied embeddings across stages, TP-replicated norms and biases, buckets
    that split matrices: over every (TP, DP, PP) rank the written boxes cover each global tensor
    once, and no DP rank writes more than its 1/DP share."""
    cfg = tiny_config(style=style, vocab_size=112).model
    for tp in (1, 2):
        for dp in (1, 2, 3, 4):
            coverage, per_rank = {}, []
            for pp_rank in range(pp):
                chunks = build_model_chunks(cfg, context(dtype=torch.float32), pp, pp_rank)
                full_named = [(n, p) for c in chunks for n, p in c.named_parameters()]
                for tp_rank in range(tp):
                    named = _rank_params(full_named, tp, tp_rank)
                    buckets, offsets = plan_buckets([p for _, p in reversed(named)], dp, 700, dist_opt)
                    for dp_rank in range(dp):
                        ranges = owned_ranges(buckets, offsets, dp_rank)
                        written = 0
                        for w in write_plan(named, ranges, tp, tp_rank):
                            cover = coverage.setdefault(w.layout.name,
                                                        torch.zeros(w.layout.global_shape, dtype=torch.int32))
                            for _, box in w.layout.boxes(w.lo, w.hi):
                                cover[_index(box)] += 1
                                written += box.numel
                        per_rank.append((written, sum(p.numel() for _, p in named), len(buckets)))
            expected = {n for c in build_model_chunks(cfg, context(dtype=torch.float32), 1, 0)
                        for n, _ in c.named_parameters()}
            assert set(coverage) == expected
            for name, cover in coverage.items():
                assert torch.all(cover == 1), (tp, dp, name, cover.unique())
            for written, held, buckets in per_rank:  # each bucket pads to a multiple of DP
                assert written <= held / dp + buckets, (tp, dp, written, held)
