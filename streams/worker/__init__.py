"""The worker's agents beyond ingest and emission: the close, undecodable batches, and
windowed streams."""
