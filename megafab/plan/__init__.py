"""Pre-launch planning beyond memory: machine profiles, the step-time model and the layout search.

machines.py      what a device and its links can do (built-in GPU nodes, or a --profile JSON)
collectives.py   alpha-beta times of each collective for a group placed on the machine (NCCL's ring latency)
step_time.py     one iteration's time from the FLOPs and bytes of a finalized Config
fsdp.py          FSDP2's per-unit gathers, reduce-scatters and copies against each layer's compute
schedule.py      how the pipeline schedule turns per-micro-batch stage times into a step
search.py        every valid layout for a model, batch and device count, ranked by predicted time
profile.py       measuring this machine (megafab-estimate --profile)
moe.py           mixture-of-experts terms: parameters (total, active, per rank), routed rows, FLOPs
"""
