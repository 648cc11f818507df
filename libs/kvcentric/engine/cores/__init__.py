"""The roles' cores: prefill, decode, colocated and mixed steps and LayerKV's control, each a synchronous engine
over the model runner; no asyncio and no network."""
