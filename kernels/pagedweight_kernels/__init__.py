"""CUDA kernels (compiled at run time through cupy) with their launchers and torch references."""
