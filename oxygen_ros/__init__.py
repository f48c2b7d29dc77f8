"""oxygen_ros: pi0.5 vision-language-action inference with unified KV cache management."""
