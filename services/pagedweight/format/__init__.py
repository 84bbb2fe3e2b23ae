"""Shared definitions: the APL block format, the paged-model directory, model configs, bits files."""
