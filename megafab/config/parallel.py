"""The parallel section of the configuration (`cfg.parallel`): how the model is laid out over the
ranks (TP, SP, PP and its virtual stages, CP, EP / ETP, DP) and how data parallelism runs (buckets,
overlap, the distributed optimizer, FSDP2 and Megatron-FSDP's strategies), under Megatron's names and
defaults. The sizes config/derive.py computes (dp, vpp, world size) are `derived` fields here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafab.config.fields import Section, derived, option

MEGATRON_FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class ParallelConfig(Section):
    tensor_model_parallel_size: int = option(1, help="TP degree: ranks that split each layer's weights.")
    pipeline_model_parallel_size: int = option(1, help="PP degree: stages the layers are split over.")
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, help="Layers per model chunk for the interleaved schedule.")
    num_virtual_stages_per_pipeline_rank: int | None = option(
        None, help="Model chunks per pipeline rank for the interleaved schedule (alternative to the above).")
    microbatch_group_size_per_vp_stage: int | None = option(
        None, flags=("--microbatch-group-size-per-virtual-pipeline-stage",),
        help="The interleaved schedule runs micro-batches through each model chunk in groups of this many "
             "(between PP and the number of micro-batches; default PP).")
    decoder_first_pipeline_num_layers: int | None = option(
        None, help="Transformer layers on the first pipeline stage; the other stages share the rest evenly.")
    decoder_last_pipeline_num_layers: int | None = option(
        None, help="Transformer layers on the last pipeline stage; the other stages share the rest evenly.")
    account_for_embedding_in_pipeline_split: bool = option(
        False,
        help="Count the embedding as one layer when splitting layers over stages: the first stage (its "
             "first virtual chunk) holds one transformer layer fewer.")
    account_for_loss_in_pipeline_split: bool = option(
        False,
        help="Count the output layer + loss as one layer when splitting: the last stage (its last virtual "
             "chunk) holds one transformer layer fewer.")
    virtual_pipeline_model_parallel_size: int | None = derived(
        None, help="Derived: model chunks per pipeline rank (vpp); None without interleaving.")
    sequence_parallel: bool = option(
        False, help="Shard activations along the sequence in the non-TP regions (needs TP > 1).")
    context_parallel_size: int = option(
        1,
        help="CP degree: ranks that split every sequence; rank r holds chunks r and 2*cp-1-r of 2*cp "
             "(Megatron's causal load balancing) and attention is exact across them.")
    cp_comm_type: str = option(
        "p2p", nargs="+",
        flag_help="p2p, allgather (or all_gather) or a2a; one value for every layer",
        help="How CP attention exchanges keys/values: p2p (ring, partial results merged by log-sum-exp), "
             "allgather (all K/V gathered), a2a (DeepSpeed-Ulysses: heads scattered, sequence gathered).")
    expert_model_parallel_size: int = option(
        1,
        help="EP degree: ranks that split each MoE layer's routed experts (each holds num_experts / EP), "
             "folded over the same ranks as TP x CP x DP x PP.")
    expert_tensor_parallel_size: int | None = option(
        None,
        help="ETP degree: ranks that split each routed expert's weights; default "
             "--tensor-model-parallel-size (resolved at start-up).")
    use_tp_pp_dp_mapping: bool = option(
        False, help="Order ranks tp-cp-ep-pp-dp (pipeline stages before data-parallel replicas) instead of "
                    "Megatron's default tp-cp-ep-dp-pp; with PP > 1 both grids' DP must be equal.")
    data_parallel_size: int | None = derived(None, help="Derived: world_size / (tp * cp * pp).")
    world_size: int | None = derived(None, help="Derived: number of processes.")
    use_distributed_optimizer: bool = option(
        False, help="Shard fp32 main params and optimizer state across data-parallel ranks.")
    overlap_grad_reduce: bool = option(False, help="Start each gradient bucket's reduction during backward.")
    overlap_param_gather: bool = option(
        False, help="Overlap the distributed optimizer's parameter all-gather with the next forward.")
    ddp_bucket_size: int | None = option(
        None, help="Elements per gradient bucket; default max(40M, 1M * dp).")
    ddp_average_in_collective: bool = option(
        False, help="Average the gradients inside the data-parallel collective (NCCL's ReduceOp.AVG) "
                    "instead of scaling them by 1/DP before a sum; on gloo, which has no AVG, the "
                    "sum after scaling is kept (the same values).")
    gradient_accumulation_fusion: bool = option(
        True, action="store_true", negation="--no-gradient-accumulation-fusion",
        help="Add the linear layers' weight gradients straight into the fp32 main-grad buffer (Megatron's "
             "default); --no-gradient-accumulation-fusion goes through param.grad and a hook instead.")
    accumulate_allreduce_grads_in_fp32: bool = option(
        True, action="store_true",
        help="Keep main gradients in fp32 for bf16/fp16 models (turned off by --grad-reduce-in-bf16).")
    grad_reduce_in_bf16: bool = option(
        False,
        help="Accumulate and reduce gradients over data parallel in bf16 (the DDP grad buffer's dtype); "
             "the optimizer still steps fp32 main params.")
    distributed_backend: str | None = option(
        None, choices=("nccl", "gloo"), help="nccl or gloo; default nccl with CUDA, gloo without.")
    distributed_timeout_minutes: float = option(
        10,
        help="Timeout of every collective; a frozen rank fails the others after this long (fractions of a "
             "minute are accepted).")
    use_torch_fsdp2: bool = option(
        False, group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="ZeRO-3 with torch FSDP2: parameters, gradients and optimizer state sharded over "
             "data-parallel ranks, one FSDP unit per transformer layer plus the embedding/output (weight "
             "gradients go through autograd: there is no main_grad buffer for gradient accumulation "
             "fusion).")
    use_megatron_fsdp: bool = option(
        False,
        flags=("--use-megatron-fsdp", "--use-custom-fsdp"),
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="Megatron-FSDP's flag: megafab runs the --data-parallel-sharding-strategy it asks for with "
             "its own engines (DDP, the distributed optimizer, FSDP2), announced at start-up.")
    megatron_fsdp_main_grads_dtype: str = option(
        "auto",
        choices=("fp32", "bf16", "fp16", "auto"),
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="With --use-megatron-fsdp: the gradients' dtype, and their reduction's when "
             "--megatron-fsdp-grad-comm-dtype is auto; the model's 16-bit dtype is --grad-reduce-in-bf16 "
             "(fp32: the default accumulation; auto: as the other flags say).")
    megatron_fsdp_grad_comm_dtype: str = option(
        "auto",
        choices=("fp32", "fp16", "bf16", "auto"),
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="With --use-megatron-fsdp: the dtype gradients are reduced in (auto: "
             "--megatron-fsdp-main-grads-dtype's); the model's 16-bit dtype is --grad-reduce-in-bf16.")
    megatron_fsdp_main_params_dtype: str = option(
        "fp32",
        choices=("fp32", "bf16", "fp16", "auto"),
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="With --use-megatron-fsdp: the dtype of the main params the optimizer steps (FSDP2's "
             "shards); fp32: masters of a 16-bit model; auto (or the model's 16-bit dtype): the model's "
             "own weights, no master copy.")
    data_parallel_sharding_strategy: str | None = option(
        None,
        choices=MEGATRON_FSDP_STRATEGIES,
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="With --use-megatron-fsdp: no_shard (ZeRO-0, replicated), optim (ZeRO-1, the distributed "
             "optimizer), optim_grads (ZeRO-2: FSDP2 keeping gathered weights to the backward), "
             "optim_grads_params (ZeRO-3: FSDP2, Megatron's default).")
    torch_fsdp2_reshard_after_forward: bool = option(
        True,
        flags=("--torch-fsdp2-no-reshard-after-forward",),
        action="store_false",
        group="ZeRO-2/3 (FSDP) and optimizer CPU offload",
        help="FSDP2 frees each unit's gathered weights after its forward and gathers them again for the "
             "backward; --torch-fsdp2-no-reshard-after-forward keeps them (more memory, one all-gather "
             "less).")
    fully_sharded: bool = derived(
        False,
        help="Derived: FSDP2 runs (--use-torch-fsdp2, or --use-megatron-fsdp with optim_grads(_params)).")

    @property
    def fsdp_reshard_after_forward(self) -> bool:
        """Whether FSDP2 frees gathered weights after forward (ZeRO-3; not Megatron-FSDP's optim_grads)."""
        if self.use_megatron_fsdp and not self.use_torch_fsdp2:
            return self.data_parallel_sharding_strategy != "optim_grads"
        return self.torch_fsdp2_reshard_after_forward
