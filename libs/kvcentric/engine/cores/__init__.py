"""The roles' cores: prefill, decode, colocated and mixed steps and LayerKV's control, each a synchronous engine
over the model runner, and each role's step behind one shape (`step.StepCore`); no asyncio and no network."""
