"""Speculative decoding (n-gram prompt lookup), wired in by the scheduler (drafts under the token budget,
verified KV only), the model runner (logits at every draft position) and the LLM (stops token by token):

    speculator.py which requests draft this step, and how many (its SpecConfig is in engine.config)
    ngram.py      proposer: the tokens that followed the most recent earlier occurrence of the context's last
                  n tokens (longest n in [prompt_lookup_min, prompt_lookup_max]), in C (csrc/ngram.c)
    rejection.py  verification: greedy (accept while draft == argmax) and rejection sampling for temperature > 0
                  (exactly the target distribution; the n-gram draft distribution is one-hot)
    gating.py     when speculating pays: expected tokens per step vs the cost of n * (k + 1) rows
"""
