"""Autoencoders shared by several families (the Wan causal 3D VAE: Wan, causal Wan, Cosmos3)."""
