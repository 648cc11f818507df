"""Adapters that put the cores on the network: the NATS bus, HTTP, gRPC KV transfer, Redis, tracing.

Asyncio code; no torch (the engines' torch side lives in `kvcentric.engine`).
"""
