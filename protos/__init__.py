"""Generated gRPC code for the polyspec API; `python -m protos.generate` rebuilds it from the .proto files."""
