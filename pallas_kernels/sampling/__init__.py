"""Drawing a token from a row of logits (temperature, min_p, inverse CDF over block masses)."""
