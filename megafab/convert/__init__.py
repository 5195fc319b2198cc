"""HuggingFace <-> megafab conversion (GPT-2 and Llama architectures)."""

from megafab.convert.checkpoint import read_checkpoint, write_checkpoint
from megafab.convert.hf_dir import architecture_of, export_hf, import_hf
from megafab.convert.state_dict import ConversionError

__all__ = ["ConversionError", "architecture_of", "export_hf", "import_hf", "read_checkpoint",
           "write_checkpoint"]
