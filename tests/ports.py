"""jetbatch's default ports, which the suite holds for its session and never binds itself:
nats-server's client port, the worker's and the classifier's HTTP endpoints."""

DEFAULT_PORTS = (4222, 9464, 9465)
