"""The commands: one module each (flags, then `main`) and the `chunk-grpo` dispatcher."""
