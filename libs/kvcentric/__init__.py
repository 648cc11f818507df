"""kvcentric: KVCache-centric, prefill/decode-disaggregated LLM serving.

Everything services share lives here: protocol, hashing, model and engine, scheduling cores, config.
"""

__version__ = "0.1.0"
