"""kvcentric messenger service: a node's host-memory KV store and its gRPC transfer endpoint."""
