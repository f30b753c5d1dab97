"""The supervisor: the head node's asyncio process that drives a job to completion."""
