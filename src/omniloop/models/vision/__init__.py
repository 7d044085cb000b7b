"""Image encoders used as components: CLIP vision (conditioning for Wan2.1 I2V / FLF2V) and the
Qwen3-VL-style ViT that Cosmos3's reasoner and Qwen3-Omni's thinker read images with."""
