"""The Redis store beside the core: each stream's buffers, running counts, windows and
life cycle, and the trusted auditor, as atomic Lua steps (`lua/`)."""
