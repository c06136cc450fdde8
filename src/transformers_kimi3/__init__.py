"""transformers-kimi3: Kimi K3 and Kimi Linear for Hugging Face Transformers."""
