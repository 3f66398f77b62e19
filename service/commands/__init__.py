"""The batch commands of ``splu``, one module per command group; `service/cli.py` puts them
together, `streams/cli.py` adds the stream's."""
