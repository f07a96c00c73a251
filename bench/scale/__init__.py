"""Many models, many consumers, many workers: what each costs the worker, the server and the
control plane, and how the live system tracks its simulator as they grow."""
