"""Choosing tokens from logits, together:

    sampler.py       SamplingParams gathered into tensors once per step; greedy, penalties, temperature, top-k /
                     top-p / min-p; the exponential race every random draw goes through
    seeded_draws.py  a seeded request's draw as a function of (seed, output position)
    rejection.py     speculation's verification: greedy, and rejection sampling with the same draws
    constrain.py     structured outputs applied: check-first choice, the grammar's mask, forced tokens, verification
                     of a constrained request's drafts (the grammar itself: engine.structured)

Nothing is re-exported here: import the defining module.
"""
