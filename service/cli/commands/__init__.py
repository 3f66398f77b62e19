"""The batch commands of ``splu``, one module per command group; `service/cli/batch.py` puts them
together, `streams/cli.py` adds the stream's."""
