"""The parts an engine service is built from: its shell (`base.EngineService`), NATS intake and outbox, load
reports, role change, the model thread and lanes, the step runner, core lending, and the KV transfers between
nodes; no model maths."""
