"""The model testers of the common tests (`ModelTesterMixin` reads them as `self.model_tester`), one per layout:
tiny configs and inputs, as Transformers' model testers build them. Also used by tests that need no Transformers
test file (test_regressions.py, test_static_cache_compile.py). Not a test module."""

import copy

import torch

from transformers_kimi3 import Kimi3Config, Kimi3Model, Kimi3TextConfig


def ids_tensor(shape, vocab_size):
    """Random token ids in [0, vocab_size) from torch's global generator (the common tests seed it)."""
    return torch.randint(0, vocab_size, tuple(shape), dtype=torch.long)


MXFP4 = {"format": "mxfp4-pack-quantized", "quant_method": "compressed-tensors",
         "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                       "weights": {"group_size": 32, "num_bits": 4, "type": "float"}}}}


class Kimi3TextModelTester:
    """Builds a tiny config of one layout and inputs for it, as Transformers' model testers do: two layers (one
    KDA with a dense MLP, one MLA with a MoE block, as the native Kimi Linear tester), the fields the mixin reads
    (batch_size, seq_length, vocab_size, hidden_size, num_hidden_layers, num_attention_heads, is_training)."""

    batch_size = 3
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 2
    layout = {}
    base_model_class = Kimi3Model  # as Transformers' causal-LM testers name it (the RoPE tests look for it)

    def __init__(self, parent):
        self.parent = parent

    def config_kwargs(self):
        kw = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.0, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, kda_layers=[1],
                                    full_attn_layers=[2]))
        kw.update(copy.deepcopy(self.layout))
        return kw

    def get_config(self):
        return Kimi3TextConfig(**self.config_kwargs())

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # rows with left-over padding on the right
        attention_mask[:, 0] = 1
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class KimiLinearTester(Kimi3TextModelTester):
    """Kimi Linear: SiLU, no AttnRes, experts in the model width, no query LoRA (as the released checkpoints)."""


class K3Tester(Kimi3TextModelTester):
    hidden_size = 64
    layout = dict(hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
                  mla_use_output_gate=True, attn_res_block_size=1, routed_expert_hidden_size=32,
                  latent_moe_use_norm=True, q_lora_rank=32)

    def config_kwargs(self):
        kw = super().config_kwargs()
        kw["linear_attn_config"].update(gate_lower_bound=-5.0, use_full_rank_gate=True)
        return kw


class K3MXFP4Tester(K3Tester):
    """K3 with the routed experts packed as MXFP4 (widths in whole 32-element groups)."""

    layout = dict(K3Tester.layout, moe_intermediate_size=32, quantization_config=MXFP4)


class Kimi3MultimodalTester(K3Tester):
    """One image per row: 2x2 patches of 4x4 pixels (one 2x2 merge: one projector row), so the placeholder expands
    to one position and the text length stays `seq_length`. The placeholder id is low, as in Transformers' VLM
    testers: the resize tests clamp input_ids to a smaller vocabulary and must keep it."""

    patch_size = 4
    image_grid = (1, 2, 2)
    media_token = 3

    @property
    def suppressed_tokens(self):
        return [self.media_token]

    def vision_kwargs(self):
        return dict(patch_size=self.patch_size, vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2,
                    vt_num_hidden_layers=1, qkv_hidden_size=32, mm_hidden_size=32, text_hidden_size=self.hidden_size,
                    init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=2)

    def get_config(self):
        return Kimi3Config(text_config=super().get_config().to_dict(), vision_config=self.vision_kwargs(),
                           media_placeholder_token_id=self.media_token)

    def prepare_config_and_inputs_for_common(self):
        config, inputs = super().prepare_config_and_inputs_for_common()
        ids = inputs["input_ids"].masked_fill(inputs["input_ids"] == self.media_token, self.media_token + 1)
        ids[:, 1] = self.media_token  # the image: second token of every row, never padding
        inputs["attention_mask"][:, 1] = 1
        t, h, w = self.image_grid
        inputs.update(input_ids=ids,
                      pixel_values=torch.rand(self.batch_size * t * h * w, 3, self.patch_size, self.patch_size),
                      grid_thws=torch.tensor([self.image_grid] * self.batch_size))
        return self.get_config(), inputs

    def slice_inputs(self, inputs, batch_size):
        """The first `batch_size` rows with their images (pixel_values are packed patches, not rows)."""
        per_image = int(torch.tensor(self.image_grid).prod())
        return {"input_ids": inputs["input_ids"][:batch_size], "grid_thws": inputs["grid_thws"][:batch_size],
                "pixel_values": inputs["pixel_values"][:batch_size * per_image]}
