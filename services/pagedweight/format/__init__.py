"""Shared definitions read by every service: the APL bit-plane format, the paged-model directory, the model config, bits files."""
