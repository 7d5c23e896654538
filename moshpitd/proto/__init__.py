"""Generated protobuf modules (make proto)."""
