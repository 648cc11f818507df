"""KV memory and its movement on one node: the host block pool, write-behind into it, layer-by-layer loads out of
it and per-layer block tables; no scheduling and no network."""
