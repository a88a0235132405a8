"""Model layers that own their kernel choice: linear (with its LinearMethod), norms, rotary, embeddings."""
