"""The local socket trainers talk to: msgpack control frames, tensors in shared memfd buffers."""
