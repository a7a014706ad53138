"""Generated gRPC code for the polyspec API; `python -m polyspec.protos.generate` rebuilds it from the .proto files."""
