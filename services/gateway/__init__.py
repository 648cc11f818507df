"""kvcentric gateway service: the OpenAI-compatible HTTP front door."""
