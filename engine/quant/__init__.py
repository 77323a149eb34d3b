"""Quantized formats, together:

    policy.py     quantization: auto / none / int8 and the KV dtype that goes with it (which builds were measured)
    int8.py       int8 weights (per-row groups of 32) and the modules that run them with integer dot products
    int8_kv.py    kv_cache_dtype: int8: the cache's block layout and the torch reference (its key shifts, which
                  run the model's attention: engine.attention.key_shift)

Nothing is re-exported here: import the defining module.
"""
