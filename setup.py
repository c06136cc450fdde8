from setuptools import setup

setup(
    name="transformers-kimi3",
    version="0.1.0",
    description="Kimi K3 / Kimi Linear for Hugging Face Transformers: exact, fast, official checkpoints",
    package_dir={"transformers_kimi3": "src/transformers_kimi3", "kimi3_kernels": "kernels/kimi3_kernels",
                 "kimi3_conversion": "conversion"},
    packages=["transformers_kimi3", "kimi3_kernels", "kimi3_kernels.kda", "kimi3_kernels.mxfp4", "kimi3_conversion"],
    entry_points={"console_scripts": [
        "kimi3-convert-k3 = kimi3_conversion.convert_k3_to_hf:main",
        "kimi3-quantize-mxfp4 = kimi3_conversion.quantize_mxfp4:main",
        "kimi3-convert-kimi-linear = kimi3_conversion.convert_kimi_linear:main",
    ]},
    package_data={"transformers_kimi3": ["*.jinja", "*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "transformers>=5.17,<6",
        "accelerate>=1.10",
        "safetensors>=0.5",
        "huggingface_hub>=1.0",
    ],
    extras_require={
        "triton": ["triton>=3.4"],
        "fla": ["fla-core>=0.6"],
        "vision": ["pillow>=10"],
        "tokenizer": ["tiktoken>=0.9"],
        "peft": ["peft>=0.17"],
        # parameterized: Transformers' test_modeling_common imports it (tests/transformers_common)
        "test": ["pytest>=8", "pytest-xdist>=3", "pillow>=10", "tiktoken>=0.9", "triton>=3.4", "peft>=0.17",
                 "parameterized>=0.9"],
    },
)
