"""Pure cores: policy, bookkeeping and arithmetic with no I/O, no clock reads, no asyncio and no torch.

The services and the simulator drive the same objects; nothing here opens a socket or a file handle on
its own (callers pass in what was read).
"""
