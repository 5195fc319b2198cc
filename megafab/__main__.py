"""`python -m megafab <tool> [flags]`: the console scripts without their installed wrappers."""

import importlib
import sys

from megafab.cli import TOOLS


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in TOOLS:
        names = ", ".join(TOOLS)
        print(f"usage: python -m megafab {{{names}}} [flags]  (each tool's --help lists its flags)",
              file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return importlib.import_module(TOOLS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
