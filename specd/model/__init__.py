"""Model architectures, loaders (Hugging Face folders, GGUF), attention backends, CPU dtype choice."""
