"""kvcentric kvs-meta service: where every KV block is, kept in Redis."""
