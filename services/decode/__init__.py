"""kvcentric decode service: takes KV in through its messenger and generates tokens in a continuous batch."""
