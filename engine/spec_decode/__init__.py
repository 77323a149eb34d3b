"""Speculative decoding (n-gram prompt lookup), wired in by the scheduler (drafts under the token budget,
verified KV only, stops token by token) and the model runner (logits at every draft position; verification:
engine.sample.rejection):

    speculator.py which requests draft this step, and how many (its SpecConfig is in engine.config)
    ngram.py      proposer: the tokens that followed the most recent earlier occurrence of the context's last
                  n tokens (longest n in [prompt_lookup_min, prompt_lookup_max]), in C (csrc/ngram.c)
    gating.py     when speculating pays: expected tokens per step vs the cost of n * (k + 1) rows
"""
