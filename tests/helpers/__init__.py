"""What several test modules share (test modules import from here, never from each other):

    driver.py       the training driver on a rank and the single-process reference it must equal
    child_hooks.py  code a test installs in processes it starts (faults, hidden packages)
    benchmarks.py   running a benchmarks/ script at its smallest flags
    flags.py        a small valid model's flags for configuration tests
    preprocess.py   the fixture tokenizers' flags
"""
