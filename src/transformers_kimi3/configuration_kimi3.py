"""Configs for Kimi K3 and the Kimi Linear family.

The configs read the official `config.json` verbatim (K3: `model_type` "kimi_k3" with a nested `text_config`
whose own `model_type` is "kimi_linear"; Kimi Linear: the official keys or the keys Transformers' native
`KimiLinearConfig` writes) and write the official keys back, so every folder we save is read by Moonshot's
code and the serving engines too. Derived views (`layer_types`, `mlp_layer_types`, ...) are properties, never
serialized.
"""

import copy
import importlib.util
import inspect
import math

from transformers import PretrainedConfig

from .mxfp8 import check_activation_format

# The values of `kda_backend` (None: triton on CUDA, else torch); kernels.py resolves them to a backend that runs.
KDA_BACKENDS = ("triton", "fla", "fla_chunk", "torch")

SUPPORTED_ACTIVATIONS = ("situ", "silu", "swish")

# keys Transformers' native KimiLinearConfig writes -> the official key
_NATIVE_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "model_max_length": "max_position_embeddings",
}
# keys of the native config that are derived there and carry no information here
_NATIVE_DERIVED = ("qk_head_dim", "head_dim", "pretraining_tp", "attention_bias", "attention_dropout")


# field -> "int" or "float" (any number); "?": null allowed. Checked before anything is derived from the fields.
_TEXT_FIELD_TYPES = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "num_experts_per_token", "num_shared_experts", "first_k_dense_replace", "moe_layer_freq",
                     "num_expert_group", "topk_group", "max_position_embeddings"), "int"),
    **dict.fromkeys(("num_key_value_heads", "q_lora_rank", "attn_res_block_size", "routed_expert_hidden_size",
                     "num_experts", "num_nextn_predict_layers"), "int?"),
    **dict.fromkeys(("rms_norm_eps", "initializer_range", "routed_scaling_factor"), "float"),
    **dict.fromkeys(("activation_situ_beta", "activation_situ_linear_beta"), "float?"),
}
_VISION_SIZES = ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "vt_hidden_size",
                 "vt_intermediate_size", "vt_num_attention_heads", "vt_num_hidden_layers", "qkv_hidden_size",
                 "mm_hidden_size", "text_hidden_size")
_VISION_FIELD_TYPES = {**dict.fromkeys(_VISION_SIZES, "int"), **dict.fromkeys(("projector_ln_eps", "rope_theta"),
                                                                              "float")}
# Sizes a config file must state: left out, they would take the full-size K3 defaults (right for `Kimi3TextConfig()`
# in Python, never for a file) and the checkpoint would then mismatch nearly every tensor.
_REQUIRED_TEXT_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts")


def _fail(field, msg):
    raise ValueError(f"Kimi3 config: `{field}` {msg}")


def _check_types(values, types, prefix=""):
    """Each field of `types` in `values` against its kind; a bool (JSON true/false) is not a number here."""
    for field, kind in types.items():
        v = values.get(field)
        if v is None and kind.endswith("?"):
            continue
        number = (int,) if kind.startswith("int") else (int, float)
        if isinstance(v, bool) or not isinstance(v, number):
            _fail(prefix + field, f"= {v!r} must be {'an integer' if number == (int,) else 'a number'}"
                  + (" or null" if kind.endswith("?") else ""))


def _check_eps(field, eps):
    if not (math.isfinite(eps) and eps > 0):
        _fail(field, f"= {eps!r} must be a positive number (the norm divides by sqrt(mean + eps))")


def _require_sizes(config_dict, prefix=""):
    """A text config read from a file must state its sizes (`_REQUIRED_TEXT_SIZES`, or the native aliases)."""
    native = {new: old for old, new in _NATIVE_ALIASES.items()}
    defaults = inspect.signature(Kimi3TextConfig.__init__).parameters
    required = _REQUIRED_TEXT_SIZES
    if config_dict.get("num_experts", config_dict.get("num_local_experts")):
        required += ("moe_intermediate_size",)
    for field in required:
        if field not in config_dict and native.get(field) not in config_dict:
            _fail(prefix + field, f"is missing from the config file; a config read from a file must state it (left "
                  f"out it would become the full-size K3 value {defaults[field].default})")


def _expert_parallel_plan():
    experts = "layers.*.block_sparse_moe.experts"
    plan = {f"{experts}.{w}": "grouped_gemm" for w in ("w1", "w3", "w2")}
    if importlib.util.find_spec("transformers.distributed.expert_parallel") is not None:
        return {experts: "ep_dispatch_experts", **plan}
    return {"layers.*.block_sparse_moe.gate": "ep_router", **plan, experts: "moe_tp_experts"}


class Kimi3TextConfig(PretrainedConfig):
    r"""Text model of Kimi K3 (and of Kimi Linear, which is the same family without AttnRes / latent MoE).

    Official keys are kept as they are: `linear_attn_config` holds the 1-indexed `kda_layers` /
    `full_attn_layers`, the KDA head layout and the K3 gate options; `attn_res_block_size` (None: plain residual
    stream as in Kimi Linear); `routed_expert_hidden_size` (None: experts work in the full width).
    Sizes default to K3's; every K3-only feature defaults to off, because a Kimi Linear `config.json` simply
    lacks those keys (`Kimi3TextConfig.k3()` gives the full K3 text config).
    """

    model_type = "kimi_k3_text"
    base_config_key = "text_config"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Tensor parallel (`tp_plan="auto"` under torchrun): dense MLP, shared experts and the routed experts' intermediate
    # width are split; the experts' partial outputs are summed before routed_expert_norm. Attention is replicated.
    base_model_tp_plan = {
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.block_sparse_moe.shared_experts.gate_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.up_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.down_proj": "rowwise",
        "layers.*.block_sparse_moe.experts.w1": "colwise",
        "layers.*.block_sparse_moe.experts.w3": "colwise",
        "layers.*.block_sparse_moe.experts.w2": "rowwise",
        "layers.*.block_sparse_moe.experts": "moe_tp_experts",
    }
    # Expert parallel: whole experts per rank. Transformers >= 5.21 dispatches with `ep_dispatch_experts`; 5.17-5.20
    # masks with `ep_router` and sums with `moe_tp_experts`.
    base_model_ep_plan = _expert_parallel_plan()

    def __init__(
        self,
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=33792,
        moe_intermediate_size=3072,
        num_hidden_layers=93,
        num_attention_heads=96,
        num_key_value_heads=None,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        mla_use_output_gate=False,
        hidden_act="silu",
        activation_situ_beta=None,
        activation_situ_linear_beta=None,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        linear_attn_config=None,
        attn_res_block_size=None,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=2,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=1.0,
        num_expert_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        use_grouped_topk=True,
        max_position_embeddings=1048576,
        use_cache=True,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        pad_token_id=163839,
        bos_token_id=163584,
        eos_token_id=163586,
        output_router_logits=False,
        kda_backend=None,
        **kwargs,
    ):
        for old, new in _NATIVE_ALIASES.items():
            if old in kwargs:
                value = kwargs.pop(old)
                if new == "num_experts":
                    num_experts = value
                elif new == "num_experts_per_token":
                    num_experts_per_token = value
                elif new == "num_shared_experts":
                    num_shared_experts = value
                elif new == "num_expert_group":
                    num_expert_group = value
                elif new == "moe_renormalize":
                    moe_renormalize = value
                elif new == "max_position_embeddings":
                    max_position_embeddings = value
        for k in _NATIVE_DERIVED:
            kwargs.pop(k, None)
        _check_types(locals(), _TEXT_FIELD_TYPES)
        if linear_attn_config is not None and not isinstance(linear_attn_config, dict):
            _fail("linear_attn_config", f"= {linear_attn_config!r} must be a mapping (or null)")
        # The native config flattens linear_attn_config and stores the schedule as type lists.
        native_layer_types = kwargs.pop("layer_types", None)
        native_mlp_types = kwargs.pop("mlp_layer_types", None)
        lac = copy.deepcopy(linear_attn_config) if linear_attn_config is not None else {}
        for native_key, key in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                                ("linear_conv_kernel_dim", "short_conv_kernel_size")):
            if native_key in kwargs:
                lac.setdefault(key, kwargs.pop(native_key))
        if native_layer_types is not None and "kda_layers" not in lac:
            lac["kda_layers"] = [i + 1 for i, t in enumerate(native_layer_types) if t == "linear_attention"]
            lac["full_attn_layers"] = [i + 1 for i, t in enumerate(native_layer_types) if t == "full_attention"]
        if native_mlp_types is not None:
            # the native config has no first_k_dense_replace: recover it (and check the list has that shape)
            dense = [t == "dense" for t in native_mlp_types]
            first_k_dense_replace = dense.index(False) if False in dense else len(dense)
            if any(dense[first_k_dense_replace:]):
                _fail("mlp_layer_types", "has dense layers after the first sparse one; only a dense prefix is supported")
            moe_layer_freq = 1
        lac.setdefault("num_heads", 32)
        lac.setdefault("head_dim", 128)
        lac.setdefault("short_conv_kernel_size", 4)
        if "kda_layers" not in lac and "full_attn_layers" not in lac:
            full = [i + 1 for i in range(num_hidden_layers) if (i + 1) % 4 == 0 or i == num_hidden_layers - 1]
            lac["full_attn_layers"] = full
            lac["kda_layers"] = [i + 1 for i in range(num_hidden_layers) if i + 1 not in full]

        # compressed-tensors settings of the official checkpoint: kept under our own name so that Transformers
        # does not build a quantizer for them (we read the packed experts ourselves), written back on save.
        self.checkpoint_quantization_config = kwargs.pop("quantization_config", None) or kwargs.pop(
            "checkpoint_quantization_config", None)

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.linear_attn_config = lac
        self.attn_res_block_size = attn_res_block_size
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.topk_method = topk_method
        self.use_grouped_topk = use_grouped_topk
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.output_router_logits = output_router_logits
        self.kda_backend = kda_backend
        self.moe_activation_format = kwargs.pop("moe_activation_format", "bf16")  # routed experts' inputs: mxfp8.py
        self.fp32_logits = kwargs.pop("fp32_logits", False)  # the LM head's output in fp32 (modeling: Kimi3LMHead)
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_kimi3()

    @classmethod
    def k3(cls, **overrides):
        """The released Kimi K3 text config (SPEC section 1), with optional overrides for smaller test models."""
        full = [4 * i for i in range(1, 24)] + [93]
        base = dict(
            hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, mla_use_output_gate=True,
            attn_res_block_size=12, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
            linear_attn_config=dict(num_heads=96, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                    use_full_rank_gate=True, full_attn_layers=full,
                                    kda_layers=[i for i in range(1, 94) if i not in full]),
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """Also the entry of every config read from a file (`from_pretrained`, AutoConfig), whose sizes must be
        stated (`_require_sizes`)."""
        if config_dict.get("model_type") == Kimi3Config.model_type:  # a K3 config has its text model nested
            _fail("text_config", "is missing from the kimi_k3 config file")
        _require_sizes(config_dict)
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        config_dict, kwargs = super().get_config_dict(*args, **kwargs)
        # Official text configs (nested or Kimi Linear) say "kimi_linear": ours on purpose, not a mismatch.
        for d in (config_dict, config_dict.get("text_config") or {}):
            if d.get("model_type") == "kimi_linear":
                d["model_type"] = cls.model_type
        if isinstance(config_dict.get("text_config"), dict):  # a K3 file: missing sizes named by their path in it
            _require_sizes(config_dict["text_config"], "text_config.")
        return config_dict, kwargs

    # ------------------------------------------------------------------ derived views
    @property
    def kda_num_heads(self):
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self):
        return self.linear_attn_config["head_dim"]

    @property
    def conv_kernel_size(self):
        return self.linear_attn_config["short_conv_kernel_size"]

    @property
    def gate_lower_bound(self):
        return self.linear_attn_config.get("gate_lower_bound")

    @property
    def use_full_rank_gate(self):
        return bool(self.linear_attn_config.get("use_full_rank_gate", False))

    @property
    def layer_types(self):
        kda = set(self.linear_attn_config.get("kda_layers", []))
        return ["linear_attention" if i + 1 in kda else "full_attention" for i in range(self.num_hidden_layers)]

    @property
    def mlp_layer_types(self):
        return ["sparse" if self._is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]

    def _is_moe_layer(self, i):
        return bool(self.num_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def use_attn_res(self):
        return self.attn_res_block_size is not None

    @property
    def expert_input_size(self):
        """Width the routed experts work in: the latent width for LatentMoE, the model width otherwise."""
        return self.routed_expert_hidden_size or self.hidden_size

    # Names some Transformers utilities look for.
    @property
    def num_local_experts(self):
        return self.num_experts

    @property
    def num_experts_per_tok(self):
        return self.num_experts_per_token

    # ------------------------------------------------------------------ validation
    def validate_kimi3(self):
        _check_types({k: getattr(self, k) for k in _TEXT_FIELD_TYPES}, _TEXT_FIELD_TYPES)
        _check_eps("rms_norm_eps", self.rms_norm_eps)
        check_activation_format(self.moe_activation_format)
        if self.kda_backend is not None and self.kda_backend not in KDA_BACKENDS:
            _fail("kda_backend", f"= {self.kda_backend!r} is not a KDA backend; choose one of {KDA_BACKENDS} or None")
        if not isinstance(self.fp32_logits, bool):
            _fail("fp32_logits", f"= {self.fp32_logits!r} must be true or false")
        L = self.num_hidden_layers
        lac = self.linear_attn_config
        _check_types(lac, {"gate_lower_bound": "float?"}, "linear_attn_config.")
        for name in ("kda_layers", "full_attn_layers"):
            if not isinstance(lac.get(name, []), (list, tuple)):
                _fail(f"linear_attn_config.{name}", f"= {lac[name]!r} must be a list of 1-indexed layers")
        kda, full = list(lac.get("kda_layers", [])), list(lac.get("full_attn_layers", []))
        for name, layers in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [x for x in layers if not isinstance(x, int) or not 1 <= x <= L]
            if bad:
                _fail(f"linear_attn_config.{name}", f"holds {bad}: layers are 1-indexed in 1..{L}")
        both = sorted(set(kda) & set(full))
        if both:
            _fail("linear_attn_config.kda_layers", f"and `full_attn_layers` both claim layers {both}")
        missing = sorted(set(range(1, L + 1)) - set(kda) - set(full))
        if missing:
            _fail("linear_attn_config.kda_layers",
                  f"and `full_attn_layers` together must cover every layer 1..{L}; missing {missing}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                _fail("num_experts_per_token", f"= {self.num_experts_per_token} must be in 1..num_experts "
                      f"({self.num_experts})")
            if self.num_expert_group < 1 or self.num_experts % self.num_expert_group:
                _fail("num_expert_group", f"= {self.num_expert_group} must divide num_experts ({self.num_experts})")
            if not 1 <= self.topk_group <= self.num_expert_group:
                _fail("topk_group", f"= {self.topk_group} must be in 1..num_expert_group ({self.num_expert_group})")
            if self.moe_router_activation_func not in ("sigmoid",):
                _fail("moe_router_activation_func", f"= {self.moe_router_activation_func!r} is not supported "
                      "(only 'sigmoid')")
        if self.attn_res_block_size is not None and (
                not isinstance(self.attn_res_block_size, int) or self.attn_res_block_size < 1):
            _fail("attn_res_block_size", f"= {self.attn_res_block_size!r} must be an integer >= 1 (or null)")
        if self.moe_layer_freq < 1:
            _fail("moe_layer_freq", f"= {self.moe_layer_freq} must be >= 1")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            _fail("hidden_act", f"= {self.hidden_act!r} is unknown; supported: {SUPPORTED_ACTIVATIONS}")
        if self.num_key_value_heads != self.num_attention_heads:
            _fail("num_key_value_heads", f"= {self.num_key_value_heads} must equal num_attention_heads "
                  f"({self.num_attention_heads}) for MLA")
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "vocab_size", "num_hidden_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                _fail(name, f"= {v!r} must be a positive integer")
        H, K = lac["num_heads"], lac["head_dim"]
        for name, v in (("linear_attn_config.num_heads", H), ("linear_attn_config.head_dim", K),
                        ("linear_attn_config.short_conv_kernel_size", lac["short_conv_kernel_size"])):
            if not isinstance(v, int) or v < 1:
                _fail(name, f"= {v!r} must be a positive integer")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size < 1:
            _fail("routed_expert_hidden_size", "must be a positive integer or null")
        lb = lac.get("gate_lower_bound")
        if lb is not None and not lb < 0:
            _fail("linear_attn_config.gate_lower_bound", f"= {lb} must be negative")
        # block-scaled MXFP4 experts need widths that are whole 32-element groups
        q = self.checkpoint_quantization_config
        if q and self.num_experts:
            for name, width in (("routed_expert_hidden_size", self.expert_input_size),
                                ("moe_intermediate_size", self.moe_intermediate_size)):
                if width % 32:
                    _fail(name, f"= {width} is not a multiple of the MXFP4 group size 32")

    def k3_only_fields(self):
        """The fields set here that Transformers' native Kimi Linear does not implement (AttnRes, SiTU, latent MoE,
        the gated MLA output, the K3 KDA gate). The native class builds from such a config a model that fails
        (`KeyError: 'situ'`) or computes something else."""
        lac = self.linear_attn_config
        found = {"attn_res_block_size": self.attn_res_block_size is not None, "hidden_act": self.hidden_act == "situ",
                 "routed_expert_hidden_size": self.routed_expert_hidden_size is not None,
                 "mla_use_output_gate": bool(self.mla_use_output_gate),
                 "linear_attn_config.gate_lower_bound": lac.get("gate_lower_bound") is not None,
                 "linear_attn_config.use_full_rank_gate": bool(lac.get("use_full_rank_gate"))}
        return [field for field, used in found.items() if used]

    def to_dict(self):
        out = super().to_dict()
        # "kimi_linear", the official text model type, where Transformers' native Kimi Linear and the engines build
        # this model; a config with K3-only fields says "kimi_k3_text", so that the Auto classes take our classes
        # (this package imported) or the folder's remote code (trust_remote_code=True) and never the native one.
        # Nested in a K3 config it is "kimi_linear" either way, as in the release (Kimi3Config.to_dict).
        out["model_type"] = self.model_type if self.k3_only_fields() else "kimi_linear"
        q = out.pop("checkpoint_quantization_config", None)
        if q:
            out["quantization_config"] = q
        if out.get("kda_backend") is None:
            out.pop("kda_backend", None)
        if not out.get("fp32_logits"):  # written only where asked for: the released configs do not have it
            out.pop("fp32_logits", None)
        return out


class Kimi3VisionConfig(PretrainedConfig):
    """MoonViT-V2 vision tower + PatchMergerMLPV2 projector (official `vision_config` keys)."""

    model_type = "kimi_k3_vision"
    base_config_key = "vision_config"

    def __init__(
        self,
        patch_size=14,
        init_pos_emb_height=64,
        init_pos_emb_width=64,
        init_pos_emb_time=4,
        pos_emb_type="divided_fixed",
        pos_emb_interpolation_mode="bilinear",
        vt_hidden_size=1024,
        vt_intermediate_size=4096,
        vt_num_attention_heads=12,
        vt_num_hidden_layers=27,
        qkv_hidden_size=1536,
        activation_func="gelu_pytorch_tanh",
        attn_bias=False,
        linear_bias=False,
        patch_embed_proj_bias=False,
        norm_type="rmsnorm",
        mlp_type="mlp2",
        merge_kernel_size=(2, 2),
        merge_type="sd2_tpool",
        mm_hidden_size=1024,
        mm_projector_type="patchmergerv2",
        projector_hidden_act="gelu",
        projector_ln_eps=1e-5,
        text_hidden_size=7168,
        rope_theta=10000.0,
        **kwargs,
    ):
        kwargs.pop("_attn_implementation", None)  # the official file pins flash_attention_2; we choose at runtime
        values = {k: v for k, v in locals().items() if k in _VISION_FIELD_TYPES}
        _check_types(values, _VISION_FIELD_TYPES, "vision_config.")
        for name in _VISION_SIZES:
            if values[name] < 1:
                _fail(f"vision_config.{name}", f"= {values[name]} must be a positive integer")
        _check_eps("vision_config.projector_ln_eps", projector_ln_eps)
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.qkv_hidden_size = qkv_hidden_size
        self.activation_func = activation_func
        self.attn_bias = attn_bias
        self.linear_bias = linear_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.norm_type = norm_type
        self.mlp_type = mlp_type
        self.merge_kernel_size = list(merge_kernel_size)
        self.merge_type = merge_type
        self.mm_hidden_size = mm_hidden_size
        self.mm_projector_type = mm_projector_type
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps
        self.text_hidden_size = text_hidden_size
        self.rope_theta = rope_theta
        super().__init__(**kwargs)
        if qkv_hidden_size % vt_num_attention_heads:
            _fail("vision_config.qkv_hidden_size",
                  f"= {qkv_hidden_size} is not divisible by vt_num_attention_heads ({vt_num_attention_heads})")

    @property
    def head_dim(self):
        return self.qkv_hidden_size // self.vt_num_attention_heads

    def to_dict(self):
        # no model_type, as in the official file's vision_config: read on its own (Kimi3VisionConfig.from_pretrained
        # of a K3 folder) or nested in Kimi3Config, the same dict
        out = super().to_dict()
        out.pop("model_type", None)
        return out


class Kimi3Config(PretrainedConfig):
    """Top-level Kimi K3 config (`model_type` "kimi_k3"): a text config, a vision config and the media token."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": Kimi3TextConfig, "vision_config": Kimi3VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=163605,
                 image_placeholder="<|kimi_image_placeholder|>", ignore_index=-100, tie_word_embeddings=False,
                 **kwargs):
        _check_types(locals(), {"media_placeholder_token_id": "int", "ignore_index": "int"})
        if text_config is None:
            text_config = Kimi3TextConfig()
        elif isinstance(text_config, dict):
            text_config = Kimi3TextConfig(**{k: v for k, v in text_config.items() if k != "model_type"})
        if vision_config is None:
            vision_config = Kimi3VisionConfig()
        elif isinstance(vision_config, dict):
            vision_config = Kimi3VisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
        self.text_config = text_config
        self.vision_config = vision_config
        self.media_placeholder_token_id = media_placeholder_token_id
        self.image_placeholder = image_placeholder
        self.ignore_index = ignore_index
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            kwargs.setdefault(key, getattr(text_config, key))
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        if not 0 <= media_placeholder_token_id < text_config.vocab_size:
            _fail("media_placeholder_token_id", f"= {media_placeholder_token_id} is outside the vocabulary "
                  f"(0..{text_config.vocab_size - 1})")

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """Also the entry of every config read from a file (`from_pretrained`, AutoConfig): the text and vision
        configs and the text sizes must be stated, never filled in with the full-size K3 defaults."""
        for key in ("text_config", "vision_config"):
            if config_dict.get(key) is None:
                _fail(key, "is missing from the kimi_k3 config file; a config read from a file must state it (left "
                      "out it would become the full-size K3 one)")
        if isinstance(config_dict["text_config"], dict):
            _require_sizes(config_dict["text_config"], "text_config.")
        return super().from_dict(config_dict, **kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.text_config

    def to_dict(self):
        out = super().to_dict()
        out["text_config"]["model_type"] = "kimi_linear"  # the release's nested text type: Moonshot's code reads it
        return out


# Official class names.
KimiK3Config = Kimi3Config

__all__ = ["Kimi3TextConfig", "Kimi3VisionConfig", "Kimi3Config", "KimiK3Config"]
