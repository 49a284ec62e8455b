"""Generated protobuf and gRPC modules for the tandem.v1 API (built from the .proto files here)."""
