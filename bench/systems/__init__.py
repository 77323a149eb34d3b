"""The systems the bench runs: one module each; ``registry`` names them."""
