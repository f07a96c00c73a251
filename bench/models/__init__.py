"""What a model costs the worker: loading from each tier, padding, and idle unload."""
