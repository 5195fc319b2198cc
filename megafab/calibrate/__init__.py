"""Measuring this machine into a machine profile (megafab-estimate --profile). It runs real
training steps (megafab.training), so it sits above them; megafab.plan reads the profile it writes
(plan.machines.Machine, the CPU-only terms through plan.host_terms) and never imports this package.

profile.py      measure(): everything below, assembled into a Machine
kernels.py      GEMMs, attention and memory bandwidth of this device
collectives.py  the timed collective loop over fork-started ranks and its alpha-beta fits
host.py         a CPU's host overheads of megafab's train_step, their fit, the busy-core slowdown
steps.py        in-step collective alphas from megafab's own steps at world 2 and 4; speed drift
stats.py        timed repeats and least-squares lines
"""
