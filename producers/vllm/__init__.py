"""producers/vllm."""
