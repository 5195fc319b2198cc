"""The estimator: what a layout needs in memory and how long its step takes, from the config and the
engine's own layer kinds (built on the meta device), before launch. It reads a machine profile and
never runs training (megafab.calibrate measures the profile, above training).

inventory.py, params.py   parameters per layer kind, chunk, stage and rank, read off the engine
activations.py            activation bytes per layer, embedding and loss (Korthikanti et al. 2022)
state_memory.py           weights, grads and optimizer state per rank (DDP, ZeRO-1, FSDP2, offload)
planner.py                the per-stage plan and its text (pretrain --dry-run, megafab-estimate)
flops.py                  model FLOPs per iteration and MFU as Megatron counts them
moe.py                    mixture-of-experts terms: routed rows, dispatcher buffers, active parameters
machines.py               device and link speeds (built-in GPU nodes, or a --profile JSON)
collectives.py, fsdp.py   alpha-beta collective times; FSDP2's per-unit gathers and reduce-scatters
layer_time.py, step_time.py   one layer's passes; one iteration's time; host_terms.py the host's share
schedule.py               the pipeline schedule through time (distributed.schedule_table's order)
search.py, layout_candidate.py, report.py   every valid layout ranked; one candidate; their text
"""
