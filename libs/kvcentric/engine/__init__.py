"""The engine: block pool and scheduling cores (pure), the torch model runner, prefill and decode roles."""
