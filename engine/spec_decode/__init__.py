"""Speculative decoding parts (issue: n-gram prompt lookup). Pure pieces, each tested on its own:

    ngram.py      proposer: the tokens that followed the most recent earlier occurrence of the context's last
                  n tokens (longest n in [prompt_lookup_min, prompt_lookup_max]), in C (csrc/ngram.c)
    rejection.py  verification: greedy (accept while draft == argmax) and rejection sampling for temperature > 0
                  (exactly the target distribution; the n-gram draft distribution is one-hot)
    gating.py     when speculating pays: expected tokens per step vs the cost of n * (k + 1) rows

NOTE: not yet wired into the scheduler / model runner; see the README's "Speculative decoding" status.
"""
