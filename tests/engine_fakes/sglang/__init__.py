"""Stand-in for sglang (see ../README.md): sgl-project/sglang at the revision each module names."""
