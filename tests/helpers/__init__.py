"""What several test modules share (test modules import from here, never from each other;
tests/test_test_layout.py holds it):

    flags.py          the tiny GPT's sizes, declared once (TINY_GPT; tiny_flags as Megatron flags), and a
                      small valid model's flags for configuration tests
    tiny.py           tiny_config (TINY_GPT's sizes), batches, the single-process reference model and
                      full gradients for parity tests
    driver.py         the training driver on a rank and the single-process reference it must equal
    checkpoint.py     a float64 TrainState of any layout (MoE too), a DP-independent training loop,
                      every tensor of a saved checkpoint
    mcore.py          megatron-core as the checkpoint oracle on CPU (its CUDA workarounds)
    mcore_moe.py      megatron-core's MoELayer as the oracle for megafab's, on CPU
    mcore_moe_gpt.py  megatron-core's MoE GPTModel on CPU and the same model as megafab's Config
    hf_tiny.py        tiny random HF GPT-2 / Llama models, megafab models from a full state dict
    hf_moe_tiny.py    tiny random HF Mixtral / Qwen3-MoE models
    toy.py            toy models with Megatron's parameter attributes (optimizer and DP tests)
    toy_expert.py     a toy mixture of experts (expert-data-parallel tests)
    launch.py         pretrain under torchrun or on forked ranks, and the log's losses
    main_ranks.py     pretrain_gpt.py's main() on N ranks forked from the test process
    tiny_corpus.py    tiny .bin/.idx corpora, the tiny run's flags, the one-message assertion
    moe_pretrain.py   the tiny MoE pretrain runs' flags and their logged-loss parity
    megatron_scripts.py  Megatron-LM's example launch scripts as argument lists
    child_hooks.py    code a test installs in processes it starts (faults, hidden packages)
    benchmarks.py     running a benchmarks/ script at its smallest flags
    preprocess.py     the fixture tokenizers' flags
"""
