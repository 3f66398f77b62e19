"""The consumer: running counts, estimates, privacy reports and the live page."""
