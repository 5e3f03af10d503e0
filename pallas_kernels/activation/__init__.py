"""The gated MLP's activation (SiLU of the gate times the up projection)."""
