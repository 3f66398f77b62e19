"""The privacy core: schemas, mechanisms, reconstruction, guarantees and planning, as
pure functions over tables and counts. Imports no Redis, Kafka or Faust."""
