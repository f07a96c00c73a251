"""jetbatch beside the systems a user would pick instead (Ray Serve, dynamic-batcher)."""
