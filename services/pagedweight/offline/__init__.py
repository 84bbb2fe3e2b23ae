"""Offline tools: evaluation, calibration, quantization, sensitivity tables."""
