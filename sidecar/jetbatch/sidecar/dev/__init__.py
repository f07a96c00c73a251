"""Tools for trying jetbatch out and testing it, apart from the serving runtime: an embedded
nats-server (``natsserver``) and the locally built example models (``example_models``)."""
