"""The node agent: one per node, started by a launcher, running that node's ranks."""
