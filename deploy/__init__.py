"""Ways to run SPLU Stream: embedded servers for the demo, benchmarks and tests (SPEC §6)."""
