"""The EngineCore: scheduler, KV cache manager and the step loop."""
