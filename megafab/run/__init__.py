"""How a megafab process lives in a job; the bottom layer (anything may use it).

    launch.py      where this process runs: torchrun / SLURM_* variables, rank identity, device and
                   backend, the rendezvous store
    report.py      the one error reporter: one message from one rank, the exit status, torchrun's
                   error file (written by the reporting rank only)
    faults.py      the fault watcher: one rank speaks for the job, the others stop quietly and soon
    signals.py     the one owner of SIGTERM (--exit-signal-handler, and leaving undisturbed)
    packages.py    optional packages named by flags, checked at start-up on every rank
    fork_ranks.py  N forked gloo ranks from one process (tests and benchmarks)
"""
