"""Where a model comes from and how it is loaded: its files (`source`: a
directory, the hub, or the built-in demo model), the random-weight models built
offline (`random_model`: the demo model and the tests' models), the embedding
settings (`embedding`) and the weights loaded into a model (`loader`)."""
