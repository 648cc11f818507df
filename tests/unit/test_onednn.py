"""fp32 projections through oneDNN (weights packed in its layout at load, beside the small GEMM's for few rows):
the same logits as torch's default GEMM to fp32 rounding, the same greedy tokens, and off with --no-onednn."""

import torch

from factories import greedy, make_pool, prompt
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.model.gemm import TwoLayouts
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset


def runner(onednn: bool) -> ModelRunner:
    return ModelRunner(preset("tiny"), 64, 4, seed=0, device="cpu", onednn=onednn)


def blocked(weight):
    """The layout of a projection that steps of many rows use (oneDNN's, or torch's own without it)."""
    return weight.blocked if isinstance(weight, TwoLayouts) else weight


def test_packed_weights_give_the_default_gemms_logits_and_greedy_tokens():
    packed, plain = runner(True), runner(False)
    layer = packed.model.layers[0]
    assert all(blocked(w).is_mkldnn for w in (layer.self_attn.qkv[0], layer.mlp.down, layer.self_attn.out[0]))
    assert not blocked(plain.model.layers[0].self_attn.qkv[0]).is_mkldnn
    tokens = prompt(40)
    logits = [r.prefill(tokens, list(range(10)), 0, 40, every_row=True) for r in (packed, plain)]
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert generate(packed, make_pool(packed), tokens, greedy(16))[0] == \
        generate(plain, make_pool(plain), tokens, greedy(16))[0]


def test_onednn_is_on_by_default_and_off_with_no_onednn():
    assert EngineConfig().onednn is True
    assert EngineConfig(onednn=False).onednn is False


def test_bf16_weights_are_left_to_torch():
    model = ModelRunner(preset("tiny"), 16, 4, dtype="bfloat16", onednn=True).model
    assert not blocked(model.layers[0].self_attn.qkv[0]).is_mkldnn


def test_a_long_cpu_mlp_runs_in_row_chunks_with_the_same_sums(monkeypatch):
    from kvcentric.engine.model import gemm, llama
    mlp = runner(True).model.layers[0].mlp
    # every chunk (the last too) more rows than the small GEMM takes, so all of them run through oneDNN
    x = torch.randn(2 * llama.MLP_ROWS + gemm.SMALL_GEMM_ROWS + 37, blocked(mlp.down).shape[0])
    residual = torch.randn(x.shape)
    chunked = mlp(x, residual)
    monkeypatch.setattr(llama, "MLP_ROWS", 1 << 20)
    assert torch.equal(chunked, mlp(x, residual))  # row by row the same arithmetic
