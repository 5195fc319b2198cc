"""Code a test installs in the Python processes it starts: a fault to inject, a package to hide.

Production code holds no test hooks; a test that needs one in processes it does not fork itself
(torchrun's workers) puts a sitecustomize.py first on their PYTHONPATH, which Python runs at start-up.
Forked ranks (megafab.run.fork_ranks, tests/helpers/main_ranks.py) take a function instead.
"""

from __future__ import annotations

import os
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def startup_hook_env(directory, code: str, env: dict | None = None) -> dict:
    """`env` (default: this process's) for processes that run `code` when Python starts."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
        f.write(textwrap.dedent(code))
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(directory), ROOT] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def hide_packages(*names: str) -> None:
    """In this process, `import NAME` (and NAME.anything) raises ImportError from now on."""
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
        sys.modules[name] = None
