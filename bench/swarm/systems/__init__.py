"""The systems the results benchmark compares, one module each with `run(spec, events)`."""
