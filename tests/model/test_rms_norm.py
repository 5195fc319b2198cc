import torch

from megafab.model.rms_norm import RMSNorm
from megafab.optim.memory import SavedActivations


def test_rms_norm_equals_torch_in_value_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 32, dtype=torch.float64, requires_grad=True)
    ours = RMSNorm(32, eps=1e-5, dtype=torch.float64)
    ref = torch.nn.RMSNorm(32, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(32, dtype=torch.float64))
        ref.weight.copy_(ours.weight)
    grad = torch.randn(6, 3, 32, dtype=torch.float64)
    (ya,), (yb,) = [ours(x)], [ref(x)]
    torch.testing.assert_close(ya, yb, rtol=0, atol=1e-12)
    gx_a, gw_a = torch.autograd.grad(ya, (x, ours.weight), grad)
    gx_b, gw_b = torch.autograd.grad(yb, (x, ref.weight), grad)
    torch.testing.assert_close(gx_a, gx_b, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw_a, gw_b, rtol=0, atol=1e-12)


def test_rms_norm_keeps_only_its_input_and_one_statistic_per_token():
    norm = RMSNorm(64, dtype=torch.bfloat16)
    x = torch.randn(16, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with SavedActivations(norm.parameters()) as saved:
        norm(x).float().sum().backward()
    assert saved.bytes == x.numel() * 2 + 16 * 2 * 4  # bf16 input + fp32 rstd [s, b, 1]
