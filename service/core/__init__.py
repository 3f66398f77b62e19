"""The privacy core: schemas, mechanisms, reconstruction, guarantees and planning, as
pure functions over tables and counts. Imports no Redis, Kafka or Faust.

scipy (stats, optimize, sparse, integrate) is imported inside the functions that call it:
every `splu` process imports these modules, most (producers, workers, the CLI's error
paths) never call them, and importing scipy takes longer than the rest of a process's
start."""
