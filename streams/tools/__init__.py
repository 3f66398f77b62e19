"""Programs around the stream: produce, run, demo, up, and the downstream reader."""
