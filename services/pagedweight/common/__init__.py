"""Code shared by several services: errors, config helpers, metric names, proto stubs."""
