"""Image encoders used as conditioning components (CLIP vision for Wan2.1 I2V / FLF2V)."""
