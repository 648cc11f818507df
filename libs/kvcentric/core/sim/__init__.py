"""Discrete-event cluster simulator that drives the live Conductor core with a virtual clock (`kvcentric sim`)."""
