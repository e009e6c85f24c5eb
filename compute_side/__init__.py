"""The compute tier: storage-node client, pipelined feature loader, head trainer."""
