"""The storage-node daemon: reads objects, runs frozen prefixes next to the store, serves features."""
