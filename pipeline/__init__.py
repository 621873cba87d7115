"""Loaders from shards to device batches (DALI / torch backends). Built in issue 3; nothing here yet."""
