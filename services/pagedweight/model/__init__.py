"""MoE causal language models (Mixtral, Qwen1.5-MoE) in plain PyTorch."""

from pagedweight.format.model_config import ModelConfig
from pagedweight.model.loader import load_model
from pagedweight.model.transformer import MoECausalLM

__all__ = ["ModelConfig", "MoECausalLM", "load_model"]
