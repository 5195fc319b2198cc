"""Console-script entry points: megafab-pretrain, -preprocess, -merge, -convert, -generate, -estimate
and -plot (each also `python -m megafab.cli.<tool>`, or `python -m megafab <tool>`). The repo's
pretrain_gpt.py and tools/*.py are thin shims over these, for Megatron habits."""

TOOLS = {
    "pretrain": "megafab.cli.pretrain",
    "preprocess": "megafab.cli.preprocess",
    "merge": "megafab.cli.merge",
    "convert": "megafab.cli.convert",
    "generate": "megafab.cli.generate",
    "estimate": "megafab.cli.estimate",
    "plot": "megafab.cli.plot",
}
