"""Export to an HF architecture without sliding windows or attention sinks (GPT-2, Llama, Qwen2/3)
refuses a model trained with --window-size or --softmax-type by name, rather than dropping them."""

import pytest

from megafab.convert import hf_gpt2, hf_llama
from megafab.convert.state_dict import ConversionError
from tests.helpers.tiny import GPT2_STYLE, LLAMA_STYLE, tiny_config


@pytest.mark.parametrize("extra,named", [(dict(window_size=(3, 0)), "--window-size (3, 0)"),
                                         (dict(softmax_type="learnable"), "--softmax-type learnable"),
                                         (dict(softmax_type="off-by-one"), "no attention sinks")])
def test_llama_and_gpt2_export_refuse_windows_and_sinks(extra, named):
    with pytest.raises(ConversionError, match=named.replace("(", r"\(").replace(")", r"\)")):
        hf_llama.check_exportable(tiny_config(style=dict(LLAMA_STYLE, rotary_percent=1.0, **extra)).model)
    with pytest.raises(ConversionError, match=named.replace("(", r"\(").replace(")", r"\)")):
        hf_gpt2.check_exportable(tiny_config(style=dict(GPT2_STYLE, **extra)).model)
    unbounded = dict(LLAMA_STYLE, rotary_percent=1.0, window_size=(-1, 0))  # no window: exports
    hf_llama.check_exportable(tiny_config(style=unbounded).model)
