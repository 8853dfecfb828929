"""Stand-in for tensorrt_llm (see ../README.md): NVIDIA/TensorRT-LLM at the revisions each module names."""
