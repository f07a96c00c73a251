"""What the request path costs: jetbatch against raw JetStream doing the same work, in one
process and as deployed, with profiles of each process and of nats-server."""
