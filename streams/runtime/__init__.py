"""What every stream process shares: Kafka clients, the Faust app and its bulk consumer,
topics, health pages and metrics."""
