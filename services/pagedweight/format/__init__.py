"""Shared definitions: the APL block format, the paged-model directory, model configs, bits files."""

# registers Gemma-4's parser with ModelConfig (model_config.FAMILY_PARSERS) before any config is read
from pagedweight.format import gemma4_config  # noqa: E402,F401
