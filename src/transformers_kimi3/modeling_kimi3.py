"""Kimi K3 / Kimi Linear text models for Transformers.

Data flow: ids -> embed -> [AttnRes mix -> norm -> KDA|MLA -> AttnRes mix -> norm -> dense|MoE] x L
-> final mix -> norm -> lm_head. Without AttnRes (Kimi Linear) the mixes are the usual residual additions.
State lives in `Kimi3Cache` only; generate(), the static-cache greedy loop and the decode steps replayed as CUDA
graphs live in generation.py. Module names follow the official checkpoint, so the tensors on disk map onto
the modules one to one except the routed experts, which are stacked per layer (see checkpoint.py).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .checkpoint import load_pretrained, save_pretrained, state_dict_for_model
from .attn_res import Kimi3AttnResNorm, Kimi3AttnResProj, attn_res_mix
from .cache import Kimi3Cache
from .configuration_kimi3 import Kimi3Config, Kimi3TextConfig
from .generation import Kimi3GenerationMixin
from .input_checks import check_input_shapes, check_input_types, check_media_inputs, check_token_ids
from .kda import Kimi3DeltaAttention
from .mla import Kimi3MLAAttention, custom_mla_mask, mla_mask
from .moe import EXPERTS_INTERFACE, Kimi3Experts, Kimi3MLP, Kimi3SparseMoeBlock, Kimi3TopkRouter
from .mxfp4 import E8M0_BIAS
from .mxfp4_experts import PackedMXFP4Experts
from .norms import Kimi3GatedRMSNorm, Kimi3RMSNorm
from .vision import Kimi3MultiModalProjector, Kimi3VisionModel, Kimi3VisionPositionEmbedding


class Kimi3DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = config.layer_types[layer_idx] == "linear_attention"
        self.self_attn = Kimi3DeltaAttention(config, layer_idx) if self.is_kda else Kimi3MLAAttention(config, layer_idx)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.block_sparse_moe = Kimi3SparseMoeBlock(config)
        else:
            self.mlp = Kimi3MLP(config, config.intermediate_size)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Kimi3RMSNorm(d, eps=eps)
        self.post_attention_layernorm = Kimi3RMSNorm(d, eps=eps)
        self.attn_res_block_size = config.attn_res_block_size
        if config.use_attn_res:
            # Layer 0's attention-side mix never runs: its bank is still empty (the embedding joins it at this
            # layer's block boundary), so attention reads the embedding itself, as in Moonshot's code. The two
            # tensors are in the official checkpoint and load and save like any other, but nothing depends on them:
            # frozen, so DistributedDataParallel needs no find_unused_parameters and optimizers skip them.
            used = layer_idx > 0
            self.self_attention_res_proj = Kimi3AttnResProj(d, trainable=used)
            self.self_attention_res_norm = Kimi3AttnResNorm(d, eps=eps, trainable=used)
            self.mlp_res_proj = Kimi3AttnResProj(d)
            self.mlp_res_norm = Kimi3AttnResNorm(d, eps=eps)

    def _attn(self, x, kda_mask, attn_mask, past_key_values, seq_idx, output_attentions, context_parallel):
        """(output, attention probabilities): the probabilities only from an MLA layer asked for them, else None
        (a KDA layer has no pairwise attention map)."""
        if self.is_kda:
            return self.self_attn(x, attention_mask=kda_mask, cache=past_key_values, seq_idx=seq_idx,
                                  context_parallel=context_parallel), None
        if output_attentions:
            return self.self_attn(x, mask=attn_mask, cache=past_key_values, output_attentions=True)
        return self.self_attn(x, mask=attn_mask, cache=past_key_values, context_parallel=context_parallel), None

    def _ffn(self, x):
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x)
        return self.mlp(x), None

    def forward(self, hidden_states, bank=None, kda_mask=None, attn_mask=None, past_key_values=None, seq_idx=None,
                output_attentions=False, context_parallel=None):
        """Kimi Linear: hidden_states is the residual stream. K3 (AttnRes): hidden_states is the partial sum of the
        current block and `bank` [B,T,n,d] the completed blocks (embedding first). context_parallel: the forward's
        `context_parallel.Pieces` when this rank holds one piece of the sequence, else None. Returns (hidden, bank,
        router, attention probabilities [B,H,T,T_total] of an MLA layer with output_attentions, else None)."""
        # With device_map the layers live on different devices: the bank and the masks follow the layer.
        dev = hidden_states.device
        bank, kda_mask, attn_mask, seq_idx = (None if t is None else t.to(dev)
                                              for t in (bank, kda_mask, attn_mask, seq_idx))
        if self.attn_res_block_size is None:
            h = hidden_states
            a, probs = self._attn(self.input_layernorm(h), kda_mask, attn_mask, past_key_values, seq_idx,
                                  output_attentions, context_parallel)
            h = h + a
            m, router_logits = self._ffn(self.post_attention_layernorm(h))
            return h + m, bank, router_logits, probs
        p = hidden_states
        x = p if bank is None else attn_res_mix(bank, p, self.self_attention_res_proj, self.self_attention_res_norm)
        if self.layer_idx % self.attn_res_block_size == 0:  # block boundary: the finished block joins the bank
            bank = p[:, :, None] if bank is None else torch.cat([bank, p[:, :, None]], dim=2)
            p = None
        a, probs = self._attn(self.input_layernorm(x), kda_mask, attn_mask, past_key_values, seq_idx,
                              output_attentions, context_parallel)
        p = a if p is None else p + a
        x = attn_res_mix(bank, p, self.mlp_res_proj, self.mlp_res_norm)
        m, router_logits = self._ffn(self.post_attention_layernorm(x))
        return p + m, bank, router_logits, probs


class Kimi3PreTrainedModel(PreTrainedModel):
    config_class = Kimi3TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Kimi3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm",
                             "e_score_correction_bias"]
    _supports_sdpa = True
    # Transformers refuses assisted decoding for stateful models: their state cannot go back to a prefix. Kimi3Cache
    # can (crop() reruns the KDA recurrence from a kept state; cache.py), so speculative decoding is allowed.
    _is_stateful = False
    _can_compile_fullgraph = False

    @classmethod
    def _can_set_experts_implementation(cls):
        # the routed experts (moe.Kimi3Experts) use Transformers' experts interface; the base class's heuristic reads
        # this module's source, which does not define them
        return EXPERTS_INTERFACE

    def get_correct_experts_implementation(self, requested_experts):
        """Unless asked otherwise, the experts' own path ("eager": decode kernels, sorted segments, torch._grouped_mm
        on CUDA, MXFP8 activations), where Transformers defaults to its "grouped_mm". Packed MXFP4 experts
        (`PackedMXFP4Experts`) always run their own kernels, whatever is set."""
        return super().get_correct_experts_implementation("eager" if requested_experts is None else requested_experts)

    @torch.no_grad()
    def _init_weights(self, module):
        # transformers.initialization skips tensors already loaded from a checkpoint (offloaded layers too)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, nn.Linear):
            if module.out_features == 1:  # AttnRes pseudo-queries: zero = uniform averaging at the start
                init.zeros_(module.weight)
            else:
                init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.Conv1d):
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif isinstance(module, (nn.Conv2d, Kimi3VisionPositionEmbedding)):
            init.normal_(module.weight, 0.0, std)
        elif isinstance(module, (Kimi3RMSNorm, Kimi3GatedRMSNorm, nn.RMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, Kimi3TopkRouter):
            init.normal_(module.weight, 0.0, std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, Kimi3Experts):
            for w in (module.w1, module.w2, module.w3):
                init.normal_(w, 0.0, std)
        elif isinstance(module, PackedMXFP4Experts):
            # packed MXFP4 experts are frozen buffers: back to their construction values (all codes 0, scales 2^0,
            # i.e. zero weights), never the uninitialised memory of a model built on the meta device
            for name in ("w1", "w3", "w2"):
                init.zeros_(getattr(module, f"{name}_packed"))
                init.constant_(getattr(module, f"{name}_scale"), E8M0_BIAS)
        elif isinstance(module, Kimi3DeltaAttention):
            # fla conventions: A_log = 0 with the bounded (safe) gate, else log U(1, 16);
            # dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]. The draws stay fp32 (the seeded stream), the
            # exp / log run in fp64: fp32 ones round differently on different CPUs' vector paths, and the bundled
            # checkpoint must rebuild bit for bit anywhere
            if module.lower_bound is not None:
                init.zeros_(module.A_log)
            else:
                init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).double().log())
            u = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).double()
            dt = u.exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))

    # ---- one on-disk format: the official layout, whatever the layout in memory
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Transformers' `from_pretrained` for the official layout; also takes `dequantize=True` (MXFP4 experts to
        bf16) and `check_finite=False` (skip the NaN / Inf check of every tensor: `checkpoint.load_pretrained`).

        Base model and heads load each other's folders, as with Transformers' `base_model_prefix`: `Kimi3Model`
        reads a `Kimi3ForCausalLM` or K3 folder (the head and vision tower are skipped and listed in
        `loading_info["unexpected_keys"]`), `Kimi3ForCausalLM` reads a `Kimi3Model` folder (the head is initialised
        and listed in `loading_info["missing_keys"]`). Any other missing tensor is a `CheckpointError` naming it,
        except a tied head (`tie_word_embeddings`) and, with `ignore_mismatched_sizes=True`, a tensor of another
        shape (`checkpoint._match`). `output_loading_info=True` returns `(model, loading_info)`."""
        if kwargs.get("state_dict") is not None or pretrained_model_name_or_path is None:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return load_pretrained(cls, pretrained_model_name_or_path, super().from_pretrained, *model_args,
                               **kwargs)

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        return save_pretrained(self, save_directory, super().save_pretrained, *args, state_dict=state_dict,
                               **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        # also the official layout that save_pretrained writes (Trainer reloads it when resuming)
        return super().load_state_dict(state_dict_for_model(self, state_dict), strict=strict, assign=assign)


class Kimi3Model(Kimi3PreTrainedModel):
    # the `context_parallel.ContextParallel` of an open `context_parallel(model)` block, else None
    _context_parallel = None

    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Kimi3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Kimi3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.use_attn_res:
            self.output_attn_res_proj = Kimi3AttnResProj(config.hidden_size)
            self.output_attn_res_norm = Kimi3AttnResNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def init_parallel_plans(self):
        """Transformers' tensor / expert parallel plans from the config, less the routed experts' entries when the
        experts are packed MXFP4 (`PackedMXFP4Experts` has no w1 / w3 / w2 to split and no expert-parallel hooks):
        each rank then holds all packed experts whole, and no `moe_tp_experts` all-reduce sums replicated outputs."""
        super().init_parallel_plans()
        if self.config.checkpoint_quantization_config and self.config.num_experts:
            experts = "layers.*.block_sparse_moe.experts"
            self._tp_plan = {k: v for k, v in self._tp_plan.items() if not k.startswith(experts)}
            self._ep_plan = {k: v for k, v in self._ep_plan.items()
                             if not k.startswith((experts, "layers.*.block_sparse_moe.gate"))}

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, output_router_logits=None,
                return_dict=None, output_attentions=None, **kwargs):
        """`attention_mask`: 2-D [batch, length] padding mask (1 = token), or, in a model without KDA layers, a 4-D
        mask [batch, 1, query_length, key_length] that is the whole attention pattern (position_ids and
        cu_seq_lens_q are then not read). With output_attentions, `attentions` holds one [B, heads, T, T_total]
        probability map per MLA layer, in layer order; KDA layers have none (as Transformers' Kimi Linear)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds")
        check_input_shapes(input_ids, inputs_embeds, attention_mask)
        custom_mask = attention_mask is not None and attention_mask.dim() == 4
        if custom_mask and "linear_attention" in self.config.layer_types:
            n = self.config.layer_types.count("linear_attention")
            raise ValueError(
                f"attention_mask is 4-D (shape {list(attention_mask.shape)}), but {n} of this model's "
                f"{len(self.config.layer_types)} layers are KDA (linear attention): each carries one recurrent state "
                "per sequence and cannot apply a pairwise mask. Pass a 2-D padding mask [batch, length] (1 = token); "
                "to keep documents packed in one row apart, restart position_ids at 0 for each (or pass cu_seq_lens_q)")
        if inputs_embeds is None:
            # a CUDA decode step must not sync the host, and a compiled graph cannot branch on tensor values
            if not (input_ids.is_cuda and input_ids.shape[1] == 1) and not torch.compiler.is_compiling():
                check_token_ids(input_ids, self.embed_tokens)
            inputs_embeds = self.embed_tokens(input_ids)
        pieces = None
        if self._context_parallel is not None:  # this rank holds one piece of each row (context_parallel.py)
            padded = attention_mask is not None and (custom_mask or not bool(attention_mask.all()))
            packed = kwargs.get("cu_seq_lens_q") is not None or packed_sequence_ids(
                position_ids, None, *inputs_embeds.shape[:2], inputs_embeds.device) is not None
            maps = self.config.output_attentions if output_attentions is None else output_attentions
            pieces = self._context_parallel.pieces(
                inputs_embeds, attention_mask=padded, past_key_values=past_key_values is not None,
                use_cache=bool(use_cache), position_ids=packed, output_attentions=bool(maps))
            attention_mask, use_cache = None, False
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        output_hidden_states = (self.config.output_hidden_states if output_hidden_states is None
                                else output_hidden_states)
        output_router_logits = (self.config.output_router_logits if output_router_logits is None
                                else output_router_logits)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cache = self._resolve_cache(past_key_values, use_cache)
        B, T = inputs_embeds.shape[:2]
        past = cache.seen_tokens if cache is not None else 0
        # a 4-D mask governs this call only: the cache's 2-D padding history continues with this call's positions
        full_mask = self._full_mask(None if custom_mask else attention_mask, cache, B, T, past, inputs_embeds.device)
        kda_mask = None if full_mask is None else full_mask[:, -T:]
        # the KDA layers take None for "every token of this call is valid", decided here once rather than in every
        # layer (each check waits for the GPU). Without past tokens _full_mask has already checked; with them (a decode
        # step of a left-padded batch, say) this call's slice can be all ones while the history is not.
        if kda_mask is not None and past > 0 and bool(kda_mask.all()):
            kda_mask = None
        # Packed documents (a training layout) are read from position_ids only without a cache: the model has no
        # positional encoding, so during generation position_ids carry no information.
        seq_idx = None
        if not custom_mask and (cache is None or (self.training and past == 0)):
            seq_idx = packed_sequence_ids(position_ids, kwargs.get("cu_seq_lens_q"), B, T, inputs_embeds.device)
            cache = None if seq_idx is not None else cache
        if cache is not None and cache.position is not None:
            # a decode step addressed by a device position (recorded as a CUDA graph, or compiled): the whole static
            # buffer under a mask built from that tensor, so the step reads no Python position
            attn_mask = cache.position_mask(inputs_embeds.device)
        elif custom_mask:
            attn_mask = custom_mla_mask(attention_mask, T, past, inputs_embeds.device)
        else:
            attn_mask = mla_mask(full_mask, T, past, inputs_embeds.device, seq_idx)

        h, bank = inputs_embeds, None
        all_hidden = (h,) if output_hidden_states else None
        routers = () if output_router_logits else None
        attentions = () if output_attentions else None
        for layer in self.layers[:self.config.num_hidden_layers]:  # fewer while an early-exit draft runs
            h, bank, router_logits, probs = layer(h, bank, kda_mask, attn_mask, past_key_values=cache,
                                                  seq_idx=seq_idx, output_attentions=output_attentions,
                                                  context_parallel=pieces)
            if output_hidden_states:
                all_hidden += (h,)
            if output_router_logits and router_logits is not None:
                routers += (router_logits,)
            if output_attentions and probs is not None:
                attentions += (probs,)
        if cache is not None:
            if cache.position is None:  # an addressed forward leaves the counters to its caller (addressed_forward)
                cache.seen_tokens += T
            cache.attention_mask = full_mask
        if self.config.use_attn_res:
            h = attn_res_mix(bank.to(h.device), h, self.output_attn_res_proj, self.output_attn_res_norm)
        h = self.norm(h)
        out = MoeModelOutputWithPast(last_hidden_state=h, past_key_values=cache, hidden_states=all_hidden,
                                     attentions=attentions, router_logits=routers)
        return out if return_dict else out.to_tuple()

    def _resolve_cache(self, past_key_values, use_cache):
        if isinstance(past_key_values, Kimi3Cache):
            return past_key_values
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            raise TypeError(f"Kimi3 models keep their state in a Kimi3Cache, got a filled "
                            f"{type(past_key_values).__name__}")
        # generate() hands an empty DynamicCache to every model; ours replaces it (and is returned in the output)
        return Kimi3Cache(self.config) if use_cache or past_key_values is not None else None

    @staticmethod
    def _full_mask(attention_mask, cache, B, T, past, device):
        """The 2-D padding mask over every position seen so far (cached ones included), or None if no padding."""
        history = getattr(cache, "attention_mask", None) if cache is not None else None
        if attention_mask is None:
            if history is None:
                return None
            attention_mask = torch.ones(B, T, dtype=history.dtype, device=device)
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be 2-D [batch, length] (or, without KDA layers, 4-D [batch, 1, "
                             f"query_length, key_length]), got shape {tuple(attention_mask.shape)}")
        if attention_mask.shape[1] == T and past > 0:  # only this call's positions: prepend the history
            prev = history if history is not None else torch.ones(B, past, dtype=attention_mask.dtype,
                                                                   device=device)
            attention_mask = torch.cat([prev.to(attention_mask.device), attention_mask], dim=1)
        if attention_mask.shape[1] != past + T:
            raise ValueError(f"attention_mask has {attention_mask.shape[1]} positions; expected {T} (this call) or "
                             f"{past + T} (cache + this call)")
        if history is None and past > 0 and T == 1 and attention_mask.is_cuda:
            return None  # a decode step on an unpadded batch: generated tokens are never padding (and no sync)
        if history is None and bool(attention_mask.all()):
            return None
        return attention_mask.to(device)


def packed_sequence_ids(position_ids, cu_seq_lens, B, T, device):
    """Document ids [B,T] when several documents share a row (position_ids restart at 0, as Transformers'
    DataCollatorWithFlattening writes them, or flash-attention `cu_seq_lens_q`), else None."""
    if cu_seq_lens is not None and B == 1:
        starts = torch.zeros(T, dtype=torch.long, device=device)
        inner = cu_seq_lens[1:-1].to(device).long()
        starts[inner[inner < T]] = 1
        return starts.cumsum(0)[None] if bool(starts.any()) else None
    if position_ids is None or T < 2:
        return None
    position_ids = position_ids.to(device).expand(B, T)
    restarts = position_ids[:, 1:] <= position_ids[:, :-1]
    if not bool(restarts.any()):
        return None
    return F.pad(restarts.long(), (1, 0)).cumsum(1)


def _addressed(cache):
    """Whether `cache` is a static Kimi3Cache inside `addressed_by(position)`: the forward writes at the device
    position and leaves the counters (`seen_tokens`, `source_tokens`) to the caller, so that the step reads no Python
    position (a CUDA graph records it once, torch.compile traces it once for every position)."""
    return isinstance(cache, Kimi3Cache) and cache.position is not None


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(a, b, out_dtype=...): bf16 / fp16 in, fp32 out (CUDA)


class Kimi3LMHead(nn.Linear):
    """The LM head (checkpoint name `lm_head.weight`). With `config.fp32_logits` a bf16 / fp16 model returns its logits
    in fp32: the GEMM accumulates in fp32 anyway, and rounding its output to bf16 (8 bits of mantissa: steps of 1/16
    at a logit of 10) decides near-ties between candidates arbitrarily. On CUDA the same bf16 GEMM writes fp32 (no
    fp32 copy of the weight); elsewhere the weight is upcast for the product."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        self.fp32_out = bool(getattr(config, "fp32_logits", False))

    @classmethod
    def holding(cls, linear, config):
        """A head over the weight of `linear` (a plain bias-free nn.Linear, e.g. the one resize_token_embeddings
        builds), so that a resized head keeps `config.fp32_logits`."""
        with torch.device("meta"):
            head = cls(config)
        head.in_features, head.out_features, head.weight = linear.in_features, linear.out_features, linear.weight
        if getattr(linear, "_is_hf_initialized", False):  # Transformers' mark: post_init must not initialise it again
            head._is_hf_initialized = True
        return head

    def forward(self, x):
        if not self.fp32_out or x.dtype == torch.float32 or self.weight.dtype == torch.float32:
            return super().forward(x)
        if x.is_cuda and x.dtype == self.weight.dtype and _MM_OUT_DTYPE:
            return torch.mm(x.reshape(-1, x.shape[-1]), self.weight.t(), out_dtype=torch.float32).view(
                *x.shape[:-1], -1)
        return F.linear(x.float(), self.weight.float())


class Kimi3ForCausalLM(Kimi3PreTrainedModel, Kimi3GenerationMixin):
    # With tie_word_embeddings (off in the released configs) the head is the input embedding: saved once, and tied
    # again by Transformers after loading (in a K3 model too, where this class is `language_model`)
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_rep"}

    def __init__(self, config):
        super().__init__(config)
        self.model = Kimi3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = Kimi3LMHead(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        if type(value) is nn.Linear and value.bias is None:
            value = Kimi3LMHead.holding(value, self.config)
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_hidden_states=None,
                output_router_logits=None, logits_to_keep=0, return_dict=None, output_attentions=None, **kwargs):
        """Returns a MoeCausalLMOutputWithPast, or with return_dict=False (argument, else config.return_dict) its
        to_tuple(): the fields that are set, in order (loss first when labels are given)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        logits = None if output_attentions or _addressed(past_key_values) else self._replayed_logits(
            self, past_key_values, input_ids, labels, output_hidden_states, output_router_logits)
        if logits is not None:  # a static-cache decode step on CUDA (generation.py)
            out = MoeCausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
            return out if return_dict else out.to_tuple()
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, output_router_logits=output_router_logits,
                         output_attentions=output_attentions, cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
                         return_dict=True)
        if out.past_key_values is not None and not _addressed(out.past_key_values):
            out.past_key_values.source_tokens += (input_ids if input_ids is not None else inputs_embeds).shape[1]
        return self._head(out, labels, logits_to_keep, return_dict, **kwargs)

    def _head(self, out, labels, logits_to_keep, return_dict=True, **kwargs):
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep else h
        else:
            h = h[:, logits_to_keep]
        context_parallel = self.model._context_parallel
        if context_parallel is not None and (labels is not None or logits_to_keep):
            raise ValueError(f"{'labels' if labels is not None else 'logits_to_keep'}: not supported under context "
                             "parallel (each rank holds a piece of the sequence: pass shift_labels, the labels shifted "
                             "on the whole sequence and split, as shard_sequence makes them)")
        logits = self.lm_head(h)
        loss = None
        shift_labels = kwargs.get("shift_labels")
        if context_parallel is not None and shift_labels is not None:
            loss = context_parallel.loss(logits, shift_labels, kwargs.get("num_items_in_batch"))
        elif labels is not None or shift_labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = MoeCausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                        hidden_states=out.hidden_states, attentions=out.attentions,
                                        router_logits=out.router_logits)
        return out if return_dict else out.to_tuple()


class Kimi3ForConditionalGeneration(Kimi3PreTrainedModel, Kimi3GenerationMixin):
    """Kimi K3: MoonViT-V2 + projector + the text model. Names match the official checkpoint (`language_model.*`,
    `vision_tower.*`, `mm_projector.*`). `input_ids` carry ONE media placeholder per image; the model expands it to
    the image's h*w/4 projector rows. Text-only inputs need no pixels."""

    config_class = Kimi3Config
    base_model_prefix = ""
    _no_split_modules = ["Kimi3DecoderLayer", "Kimi3VisionBlock"]
    _tied_weights_keys = {}

    def __init__(self, config):
        super().__init__(config)
        self.language_model = Kimi3ForCausalLM(config.text_config)
        self.vision_tower = Kimi3VisionModel(config.vision_config)
        self.mm_projector = Kimi3MultiModalProjector(config.vision_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def set_output_embeddings(self, value):  # resize_token_embeddings replaces the head through this
        self.language_model.set_output_embeddings(value)

    def get_image_features(self, pixel_values, grid_thws):
        """[sum_i h_i*w_i/4, text hidden] projector rows for the packed images / videos."""
        dtype = self.mm_projector.proj[0].weight.dtype
        return self.mm_projector(self.vision_tower(pixel_values.to(dtype), grid_thws))

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, grid_thws=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None, output_hidden_states=None,
                output_router_logits=None, logits_to_keep=0, return_dict=None, image_grid_thw=None,
                output_attentions=None, **kwargs):
        """Returns a MoeCausalLMOutputWithPast (attentions: the text model's MLA layers), or with return_dict=False
        (argument, else config.return_dict) its to_tuple()."""
        grid_thws = grid_thws if grid_thws is not None else image_grid_thw
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        logits = None if output_attentions or _addressed(past_key_values) else self._replayed_logits(
            self.language_model, past_key_values, input_ids, labels, output_hidden_states, output_router_logits)
        if logits is not None:  # a static-cache decode step on CUDA (generation.py)
            out = MoeCausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
            return out if return_dict else out.to_tuple()
        if pixel_values is not None and self.language_model.model._context_parallel is not None:
            raise ValueError("pixel_values: images are not supported under context parallel (each placeholder "
                             "expands to its image's rows, which would move the split)")
        check_input_types(pixel_values=pixel_values, grid_thws=grid_thws)
        check_input_shapes(input_ids, inputs_embeds, attention_mask)
        n_source = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        cache_started = isinstance(past_key_values, Kimi3Cache) and past_key_values.seen_tokens > 0
        if not cache_started:
            check_media_inputs(input_ids, pixel_values, self.config.media_placeholder_token_id)
        if pixel_values is not None and not cache_started:
            if input_ids is None:
                raise ValueError("Images need input_ids with media placeholders, not inputs_embeds")
            if grid_thws is None:
                raise ValueError("pixel_values were given without grid_thws")
            if attention_mask is not None and attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be 2-D [batch, length] with pixel_values (each placeholder "
                                 f"expands to its image's rows), got shape {list(attention_mask.shape)}")
            check_token_ids(input_ids, self.get_input_embeddings())
            features = self.get_image_features(pixel_values, grid_thws)
            inputs_embeds, attention_mask, labels = self._merge_image_features(
                input_ids, features, grid_thws, attention_mask, labels)
            input_ids = None
        lm = self.language_model
        out = lm.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                       inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
                       output_router_logits=output_router_logits, output_attentions=output_attentions,
                       position_ids=position_ids if pixel_values is None else None,
                       cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), return_dict=True)
        if out.past_key_values is not None and not _addressed(out.past_key_values):
            out.past_key_values.source_tokens += n_source
            if pixel_values is not None and not cache_started:  # crop() cannot land inside the expanded media
                out.past_key_values.media_end = out.past_key_values.source_tokens
        return lm._head(out, labels, logits_to_keep, return_dict, **kwargs)

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """Rows repeated `expand_size` times (beam search, num_return_sequences). Transformers repeats every tensor
        argument along dim 0, but `pixel_values` are the patches of all images packed together and `grid_thws` has
        one row per image: each prompt row's images (its placeholders, in order) are repeated as whole blocks."""
        media = {k: model_kwargs.pop(k) for k in ("pixel_values", "grid_thws", "image_grid_thw")
                 if model_kwargs.get(k) is not None}
        expanded_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs)
        grid_key = "grid_thws" if "grid_thws" in media else "image_grid_thw"
        if expand_size > 1 and "pixel_values" in media and grid_key in media and input_ids is not None:
            grid = media[grid_key]
            per_row = (input_ids == self.config.media_placeholder_token_id).sum(1).tolist()
            images = media["pixel_values"].split(grid.prod(-1).tolist())
            rows_images, rows_grids, start = [], [], 0
            for n in per_row:
                rows_images.append(images[start:start + n])
                rows_grids.append(grid[start:start + n])
                start += n
            media["pixel_values"] = torch.cat([p for row in rows_images for _ in range(expand_size) for p in row])
            media[grid_key] = torch.cat([g for g in rows_grids for _ in range(expand_size)])
        model_kwargs.update(media)
        return expanded_ids, model_kwargs

    def _media_rows(self, grid_thws):
        """Projector rows per image / video: h*w over the merge kernel's area."""
        kh, kw = self.config.vision_config.merge_kernel_size
        return [int(h * w // (kh * kw)) for _, h, w in grid_thws.tolist()]

    def _expanded_positions(self, kwargs):
        grid = kwargs.get("grid_thws", kwargs.get("image_grid_thw"))
        if grid is None or kwargs.get("pixel_values") is None:
            return 0
        return sum(n - 1 for n in self._media_rows(grid))  # each placeholder becomes its image's rows

    def _merge_image_features(self, input_ids, features, grid_thws, attention_mask, labels):
        """Replace each placeholder by its image's rows; rows that grow by different amounts are left-padded."""
        token = self.config.media_placeholder_token_id
        counts = self._media_rows(grid_thws)
        n_placeholders = int((input_ids == token).sum())
        if n_placeholders != len(counts):
            raise ValueError(f"input_ids hold {n_placeholders} media placeholders (id {token}) but {len(counts)} "
                             "images/videos were given; put exactly one placeholder per image")
        per_image = features.split(counts)
        embed = self.get_input_embeddings()
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows, masks, labs, image = [], [], [], 0
        for b in range(input_ids.shape[0]):
            pieces, mask_pieces, label_pieces = [], [], []
            ids = input_ids[b]
            text_embeds = embed(ids.masked_fill(ids == token, 0))
            start = 0
            for pos in (ids == token).nonzero().flatten().tolist():
                pieces += [text_embeds[start:pos], per_image[image].to(text_embeds.dtype)]
                mask_pieces += [attention_mask[b, start:pos], attention_mask[b, pos].repeat(counts[image])]
                if labels is not None:
                    label_pieces += [labels[b, start:pos], labels.new_full((counts[image],), -100)]
                image, start = image + 1, pos + 1
            pieces.append(text_embeds[start:])
            mask_pieces.append(attention_mask[b, start:])
            if labels is not None:
                label_pieces.append(labels[b, start:])
            rows.append(torch.cat(pieces))
            masks.append(torch.cat(mask_pieces))
            labs.append(torch.cat(label_pieces) if labels is not None else None)
        width = max(r.shape[0] for r in rows)
        left = [width - r.shape[0] for r in rows]
        embeds = torch.stack([torch.nn.functional.pad(r, (0, 0, n, 0)) for r, n in zip(rows, left)])
        mask = torch.stack([torch.nn.functional.pad(m, (n, 0)) for m, n in zip(masks, left)])
        if labels is not None:
            labels = torch.stack([torch.nn.functional.pad(lab, (n, 0), value=-100) for lab, n in zip(labs, left)])
        return embeds, mask, labels


# Official class names.
KimiLinearForCausalLM = Kimi3ForCausalLM
KimiK3ForConditionalGeneration = Kimi3ForConditionalGeneration

# Trainer's label smoothing shifts the labels (next-token targets) only for the class names in this table, and the
# text-generation pipeline checks it; Transformers lists each of its causal LMs there. Listed here, not in the
# package's __init__, so that a saved folder loaded as remote code gets the same.
for _model_type, _cls in (("kimi_k3_text", Kimi3ForCausalLM), ("kimi_k3", Kimi3ForConditionalGeneration)):
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(_model_type, _cls.__name__)

__all__ = ["Kimi3PreTrainedModel", "Kimi3Model", "Kimi3ForCausalLM", "Kimi3ForConditionalGeneration",
           "Kimi3DecoderLayer", "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM"]
