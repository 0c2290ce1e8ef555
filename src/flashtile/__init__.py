"""flashtile: FlashAttention, derived."""
