"""Serving: the gRPC server, its request loop, batch jobs, metrics and the OpenAI-compatible HTTP endpoint."""
