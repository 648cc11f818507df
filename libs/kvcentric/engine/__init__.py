"""The engine: the model and its kernels (`model`), KV memory and movement on a node (`kv`), the roles' cores
(`cores`) and the service parts (`service`), configured by `config`; everything here that touches torch."""
