"""Routed experts in megafab's checkpoint layout, at the key and box level: the grammar of
sequential / grouped / torch_dist expert names, one global expert axis that every EP x ETP layout
and both expert layouts tile exactly once, and the translation of those boxes to Megatron's stacked
[L, E, 2f, h] torch_dist tensor."""

import itertools
import types

import pytest
import torch

from megafab import param_names as keys
from megafab.checkpoint.layout import ExpertPlacement, Shard, from_stored, param_layout, to_stored
from megafab.checkpoint.megatron_keys import megafab_view, to_megatron

L, E, H, F_ = 3, 4, 8, 6  # layers, experts, hidden, expert ffn
SEQ = "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"
GROUPED = "decoder.layers.2.mlp.experts.linear_fc1.weight"


def test_expert_name_grammar():
    assert keys.sequential_expert(SEQ) == (1, GROUPED)
    assert keys.sequential_expert(GROUPED) is None
    assert keys.sequential_expert_name(GROUPED, 1) == SEQ
    assert keys.experts_name(SEQ) == keys.experts_name(GROUPED) == GROUPED
    assert keys.dist_expert_name(GROUPED) == "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"
    assert keys.undist_expert_name(keys.dist_expert_name(GROUPED)) == GROUPED
    assert keys.stacked_name(keys.dist_expert_name(GROUPED)) == (
        "decoder.layers.mlp.experts.experts.linear_fc1.weight", 2)
    router, gate = "decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.shared_experts.gate_weight"
    for name in (SEQ, GROUPED, router, gate):
        assert keys.is_moe_name(name)
    assert keys.is_routed_expert(SEQ) and not keys.is_routed_expert("decoder.layers.0.mlp.router.weight")
    assert not keys.is_moe_name("decoder.layers.0.mlp.linear_fc1.weight")
    # ETP splits the expert's output rows (fc1, strided by SwiGLU) and input columns (fc2), one dim
    # lower in a sequential expert than in the grouped [E, out, in] tensor; the router is replicated
    assert keys.tp_partition(GROUPED, True) == (1, 2) and keys.tp_partition(SEQ, True) == (0, 2)
    assert keys.tp_partition(GROUPED.replace("fc1", "fc2"), True) == (2, 1)
    assert keys.tp_partition(SEQ.replace("fc1", "fc2"), False) == (1, 1)
    assert keys.tp_partition("decoder.layers.0.mlp.router.weight", True) is None
    assert keys.tp_partition("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", True) == (0, 2)


def test_megatron_expert_extra_state_keys_are_megatron_cores():
    assert keys.expert_extra_state_key("linear_fc1", 1, 2, 3, 4) == \
        "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4"
    assert keys.expert_extra_state_key("linear_fc2", 1, None, 3, 4) == \
        "decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_3_4"
    assert keys.layer_extra_state_key("mlp.shared_experts.linear_fc1", 1) == \
        "decoder.layers.1.mlp.shared_experts.linear_fc1._extra_state/shard_0_1"


def _local_params(fc: str, ep: int, etp: int, etp_rank: int, grouped: bool, swiglu: bool, bias: bool):
    """(name, tensor holding its global values) of one EP x ETP rank's expert params of layer 2."""
    out_rows = F_ * (2 if swiglu else 1)
    local = E // ep
    if fc == "linear_fc1":
        shape = (out_rows // etp, H) if not bias else (out_rows // etp,)
    else:
        shape = (H, F_ // etp) if not bias else (H,)
    what = "bias" if bias else "weight"
    if grouped:
        return [(f"decoder.layers.2.mlp.experts.{fc}.{what}", torch.empty(local, *shape))]
    return [(f"decoder.layers.2.mlp.experts.local_experts.{i}.{fc}.{what}", torch.empty(shape))
            for i in range(local)]


@pytest.mark.parametrize("fc,bias", [("linear_fc1", False), ("linear_fc2", False), ("linear_fc1", True),
                                     ("linear_fc2", True)])
@pytest.mark.parametrize("swiglu", [True, False])
def test_every_ep_etp_layout_tiles_the_global_expert_tensor_once(fc, bias, swiglu):
    boxes_by_layout = {}
    for ep, etp, grouped in itertools.product((1, 2, 4), (1, 2), (False, True)):
        hits, boxes, shape = None, set(), None
        for ep_rank, etp_rank in itertools.product(range(ep), range(etp)):
            placement = ExpertPlacement(E, ep_rank * (E // ep), etp, etp_rank, swiglu)
            for name, p in _local_params(fc, ep, etp, etp_rank, grouped, swiglu, bias):
                layout = param_layout(name, p, tp=1, tp_rank=0, experts=placement)
                assert layout.name == f"decoder.layers.2.mlp.experts.{fc}.{'bias' if bias else 'weight'}"
                shape = shape or layout.global_shape
                assert layout.global_shape == shape and shape[0] == E
                if layout.replica:  # an ETP-replicated bias: ETP rank 0 writes it
                    assert etp_rank > 0 and bias and fc == "linear_fc2"
                    continue
                hits = torch.zeros(shape, dtype=torch.int32) if hits is None else hits
                for _, box in layout.boxes():
                    hits[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] += 1
                    boxes.add((box.offsets, box.sizes))
        assert (hits == 1).all(), (ep, etp, grouped)
        boxes_by_layout[(ep, etp, grouped)] = boxes
    for ep, etp in itertools.product((1, 2, 4), (1, 2)):  # sequential and grouped: the same boxes per expert
        def per_expert(boxes):
            return sorted((o[0] + i, o[1:], s[1:]) for o, s in boxes for i in range(s[0]))
        assert per_expert(boxes_by_layout[(ep, etp, False)]) == per_expert(boxes_by_layout[(ep, etp, True)])


def test_expert_boxes_become_megatrons_stacked_tensor_rows():
    cfg = types.SimpleNamespace(num_layers=L, swiglu=True, transformer_impl="local")
    full = torch.arange(E * 2 * F_ * H, dtype=torch.float32).view(E, 2 * F_, H)  # [E, 2f, h]
    stored = to_stored(GROUPED, full, cfg)
    assert stored.shape == (E, 2, F_, H) and torch.equal(from_stored(GROUPED, stored, cfg), full)
    # EP 2 x ETP 2: each rank's rows of two experts, its ETP block of gate and of up
    shards = {}
    for ep_rank, etp_rank in itertools.product(range(2), range(2)):
        p = full.view(E, 2, F_, H)[ep_rank * 2:ep_rank * 2 + 2, :, etp_rank * 3:etp_rank * 3 + 3]
        p = p.contiguous()
        placement = ExpertPlacement(E, ep_rank * 2, 2, etp_rank, True)
        layout = param_layout(GROUPED, p.view(2, 6, H), 1, 0, placement)
        shards[(ep_rank, etp_rank)] = {"model." + GROUPED: layout.whole(p.view(2, 6, H))}
    target = torch.full((L, E, 2 * F_, H), -1.0)
    for shard in shards.values():
        [(key, megatron)] = to_megatron(shard, cfg).items()
        assert key == "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        assert megatron.global_shape == (L, E, 2 * F_, H)
        for box, view in zip(megatron.boxes, megatron.views):
            target[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] = view
    assert torch.equal(target[2], full) and (target[:2] == -1).all()
    # the reading side: Megatron's metadata -> megafab keys, per layer, stored view
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    md = {"decoder.layers.mlp.experts.experts.linear_fc1.weight":
          TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((L, E, 2 * F_, H)), [])}
    view = megafab_view(md, cfg, "ckpt")
    assert {k: tuple(v.size) for k, v in view.items()} == {
        f"model.decoder.layers.{i}.mlp.experts.linear_fc1.weight": (E, 2, F_, H) for i in range(L)}
    assert isinstance(Shard.whole(stored), Shard)


def test_an_unfused_pre_mlp_norm_is_read_where_the_checkpoint_keeps_it():
    """megatron-core's local spec stores an MoE layer's pre-MLP norm fused-named
    (`mlp.linear_fc1.layer_norm_weight`, what megafab writes); Transformer Engine's spec keeps
    `pre_mlp_layernorm.weight` (no linear_fc1 in an MoE layer): reading follows the checkpoint."""
    cfg = types.SimpleNamespace(num_layers=L, swiglu=True, transformer_impl="local")
    norm = torch.ones(H)
    shards = {"model.decoder.layers.1.pre_mlp_layernorm.weight": Shard.whole(norm),
              "optim.decoder.layers.1.pre_mlp_layernorm.weight.exp_avg": Shard.whole(norm)}
    fused = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert set(to_megatron(shards, cfg)) == {fused, "optimizer.state.exp_avg." + fused}
    te_spec = {"decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.self_attention.linear_qkv.weight"}
    unfused = "decoder.layers.pre_mlp_layernorm.weight"
    read = to_megatron(shards, cfg, stored_keys=te_spec)
    assert set(read) == {unfused, "optimizer.state.exp_avg." + unfused}
