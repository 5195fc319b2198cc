"""Raw text -> Megatron .bin/.idx, on one machine (worker processes) or a Ray cluster.

    cli.main(argv) -> exit code         tools/preprocess_data.py (Megatron's flags + cleaning + --ray)
    encoders.build_encoder(spec, ...)   Megatron's token ids on gigatoken or the reference libraries
    blocks.read_blocks / process_block  the unit of work both pipelines share
    cleaning / dedup / report           opt-in rules, first-copy-wins dedup, the per-rule report
    pipeline.run_local / run_partitions the single-machine driver (bounded memory, ordered output)
    ray_pipeline.run_ray                the same on Ray Data, byte-identical

Nothing here imports torch: the tool starts in well under a second.
"""
