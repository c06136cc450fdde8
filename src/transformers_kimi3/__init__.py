"""transformers-kimi3: Kimi K3 and Kimi Linear for Hugging Face Transformers.

Importing the package registers `kimi_k3` (and our text config type) with the Auto classes. If a Transformers
release ships its own `kimi_k3`, theirs stays registered and ours is reachable through the explicit classes
(`Kimi3ForCausalLM.from_pretrained(...)`) or through `trust_remote_code=True` on a folder we saved.
"""

import logging

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
)

from .cache import Kimi3Cache
from .configuration_kimi3 import Kimi3Config, Kimi3TextConfig, Kimi3VisionConfig, KimiK3Config
from .distributed import apply_fsdp2
from .expert_offload import ExpertOffload, offload_experts
from .image_processing_kimi3 import Kimi3ImageProcessor
from .kernels import kernel_status
from .modeling_kimi3 import (
    Kimi3ForCausalLM,
    Kimi3ForConditionalGeneration,
    Kimi3Model,
    Kimi3PreTrainedModel,
    KimiK3ForConditionalGeneration,
    KimiLinearForCausalLM,
)
from .muon import PerHeadMuon, build_per_head_muon
from .placement import DevicePlan, plan_device_map
from .processing_kimi3 import Kimi3Processor, kimi3_output_to_message, parse_kimi3_output
from .qat import QATMastersCallback, prepare_qat
from .tiny_tokenizer import build_tiny_tokenizer
from .tokenization_kimi3 import Kimi3Tokenizer, Kimi3TokenizerFast

logger = logging.getLogger("transformers_kimi3")

__version__ = "0.1.0"


def _register(name, config_cls, pairs):
    try:
        AutoConfig.register(name, config_cls)
    except ValueError:
        logger.warning(f"Transformers already defines model type {name!r}: keeping its classes; use "
                       "transformers_kimi3's classes explicitly or trust_remote_code=True to get ours")
        return
    for auto, model_cls in pairs:
        try:
            auto.register(config_cls, model_cls)
        except ImportError as e:  # Transformers 5.17 without torchvision: AutoImageProcessor is a stub
            logger.info(f"{model_cls.__name__} not registered with {auto.__name__}: {str(e).strip()[:80]}")


_register(Kimi3TextConfig.model_type, Kimi3TextConfig,
          [(AutoModel, Kimi3Model), (AutoModelForCausalLM, Kimi3ForCausalLM)])

# As Transformers does for Gemma 3: every Auto class gives the one class that serves text and images.
_register(Kimi3Config.model_type, Kimi3Config,
          [(AutoModel, Kimi3ForConditionalGeneration), (AutoModelForCausalLM, Kimi3ForConditionalGeneration),
           (AutoModelForImageTextToText, Kimi3ForConditionalGeneration), (AutoProcessor, Kimi3Processor),
           (AutoImageProcessor, Kimi3ImageProcessor)])

# `save_pretrained` writes auto_map and copies the flat modules, so saved folders load without this package.
Kimi3TextConfig.register_for_auto_class()
Kimi3Config.register_for_auto_class()
Kimi3Model.register_for_auto_class("AutoModel")
Kimi3ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
Kimi3ForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")
Kimi3Processor.register_for_auto_class()
Kimi3ImageProcessor.register_for_auto_class()

__all__ = ["Kimi3Cache", "Kimi3Config", "Kimi3TextConfig", "Kimi3VisionConfig", "KimiK3Config", "Kimi3Model",
           "Kimi3ForCausalLM", "Kimi3ForConditionalGeneration", "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM",
           "Kimi3PreTrainedModel", "Kimi3ImageProcessor", "Kimi3Processor", "Kimi3Tokenizer", "Kimi3TokenizerFast",
           "build_tiny_tokenizer", "kimi3_output_to_message", "parse_kimi3_output", "kernel_status",
           "PerHeadMuon", "build_per_head_muon", "prepare_qat", "QATMastersCallback", "apply_fsdp2",
           "plan_device_map", "DevicePlan",
           "offload_experts", "ExpertOffload"]
