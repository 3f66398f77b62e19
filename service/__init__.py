"""SPLU Stream's privacy core: schema, mechanisms, reconstruction, guarantees.

Pure functions over numpy arrays; importable without Kafka or Redis.
"""
