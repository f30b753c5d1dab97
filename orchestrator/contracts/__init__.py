"""The contracts every process of a job shares: what crosses a process boundary or a file.

The job's and a node's states (``state``), the ``ORCH_*`` environment (``env``), the agent
protocol (``protocol``), the events a rank sends (``worker_events``) and the journal's
(``events``), rank 0's step records (``steprecord``), the run directory's file names
(``rundir``), who may speak (``auth``), the bounded reader every file read back goes through
(``readback``), the fault-injection plan (``chaos``), the step pace a rank reports
(``pace``) and the phases it reports (``phases``). The supervisor, the agents, the worker SDK and the trainer all import these;
nothing here imports any of them.
"""
