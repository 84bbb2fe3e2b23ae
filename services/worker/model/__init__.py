"""MoE causal language models (Mixtral, Qwen1.5-MoE) in plain PyTorch."""

from services.worker.model.config import ModelConfig
from services.worker.model.loader import load_model
from services.worker.model.transformer import MoECausalLM

__all__ = ["ModelConfig", "MoECausalLM", "load_model"]
