"""Transformers' static-cache contract for our hybrid cache (issue 51 item 9), and the parts of it that cannot hold.

Holds, tested here and in generation_tester.py (every layout):
- `generate(..., cache_implementation="static")` returns the same tokens and logits as the dynamic cache, in a
  fixed-size cache: `max_length` positions (prompt positions, media rows included, plus max_new_tokens), MLA latents
  in [B, max_length, kv_lora_rank + qk_rope_head_dim] buffers and KDA states of fixed shape.
- Every state is written in place during decoding: the tensors keep their addresses (`storage_version` unchanged),
  which a CUDA graph or a compiled step needs.
- A decode step addressed by a device position (`with cache.addressed_by(position): model(...)`) compiles with
  `torch.compile(fullgraph=True)`, runs at every later position without recompiling, and gives the eager logits.

Does not hold, by design of the hybrid cache:
- `isinstance(cache, transformers.StaticCache)` and per-layer `cache.layers[i].keys` of shape
  [B, kv_heads, max_cache_len, head_dim]: Kimi3Cache keeps MLA's compressed latent per token (576 values for K3, not
  per-head keys and values) and KDA's conv and recurrent states, in one class for the dynamic and static modes.
- generate() compiling the forward by itself (`cache.is_compileable` is False): Transformers' loop calls the forward
  with Python-int positions, which a traced graph would freeze; on CUDA our static decode step is replayed as a CUDA
  graph instead (generation.py), and the compiled step above is what a caller compiles.
- A compiled prefill with padding or packed documents: the padding plan of the KDA layers is read on the host.
"""

import pytest
import torch

from testers import K3Tester, KimiLinearTester
from transformers_kimi3 import Kimi3Cache, Kimi3ForCausalLM

pytestmark = pytest.mark.transformers_common


def _model_and_ids(tester):
    config, inputs = tester(None).prepare_config_and_inputs_for_common()
    torch.manual_seed(0)
    return Kimi3ForCausalLM(config).eval(), inputs["input_ids"]


@pytest.fixture(params=[KimiLinearTester, K3Tester], ids=["kimi_linear", "k3"])
def model_and_ids(request):
    return _model_and_ids(request.param)


def _state_addresses(cache):
    return [t.data_ptr() for t in cache._tensors()]


def test_static_generate_cache_is_fixed_size_and_written_in_place(model_and_ids):
    model, ids = model_and_ids
    config, (B, T), new = model.config, ids.shape, 4
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0,
                             cache_implementation="static", return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, Kimi3Cache) and cache.max_length == T + new
    width = config.kv_lora_rank + config.qk_rope_head_dim
    for kind, latent in zip(config.layer_types, cache.latents):
        assert (latent is None) == (kind == "linear_attention")
        if latent is not None:
            assert tuple(latent.shape) == (B, T + new, width)
    # decoding further on a static cache: same tensors, same addresses, no reallocation
    cache = Kimi3Cache(config, max_length=T + new)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        addresses, version = _state_addresses(cache), cache.storage_version
        for t in range(new):
            model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
    assert _state_addresses(cache) == addresses and cache.storage_version == version


def _step(model, cache, tok, position):
    with cache.addressed_by(position):
        return model(input_ids=tok, past_key_values=cache, use_cache=True).logits


def test_compiled_decode_step_is_one_full_graph_for_every_position():
    """torch.compile(fullgraph=True) (Dynamo capture; the eager backend keeps the CPU test fast, code generation is
    the compiler's business) of a decode step addressed by a device position: traced once, reused at later positions
    (compiling again raises under the "fail_on_recompile" stance), logits equal to eager decoding within fp32
    rounding (1e-6 absolute: the same kernels run). The K3 layout has every module Kimi Linear has (KDA, MLA, MoE)
    and AttnRes and the latent MoE besides; a trace costs ~7 s of CPU time, so one layout."""
    model, ids = _model_and_ids(K3Tester)
    config = model.config
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="eager")
    eager_cache, cache = Kimi3Cache(config, max_length=16), Kimi3Cache(config, max_length=16)
    try:
        with torch.no_grad():
            model(input_ids=ids, past_key_values=eager_cache, use_cache=True)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            tok = ids[:, -1:].clone()
            for step in range(3):
                expected = model(input_ids=tok, past_key_values=eager_cache, use_cache=True).logits
                if step == 1:
                    torch.compiler.set_stance("fail_on_recompile")
                got = compiled(model, cache, tok, torch.tensor([cache.seen_tokens]))
                assert cache.seen_tokens == eager_cache.seen_tokens - 1  # the caller advances an addressed step
                cache.seen_tokens += 1
                cache.source_tokens += 1
                torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
                tok = expected.argmax(-1)
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()
