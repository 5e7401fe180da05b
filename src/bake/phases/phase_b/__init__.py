"""The repairs of the structure that ships: least squares on ``down_proj``, then Phase B's
gradient repair of the FFN."""
