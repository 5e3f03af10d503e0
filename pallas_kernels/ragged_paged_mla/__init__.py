"""Multi-head latent attention (DeepSeek's MLA) over a paged latent cache."""
