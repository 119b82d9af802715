"""Domain (latitude) parallelism: row algebra, exchange, layers, conversion and sharding."""
