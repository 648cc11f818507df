"""kvcentric conductor service: the global scheduler that answers kvc.conductor.schedule."""
