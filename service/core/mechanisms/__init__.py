"""One module per mechanism (SPEC §2)."""
