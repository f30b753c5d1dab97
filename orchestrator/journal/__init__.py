"""The run's journal and what is folded from it.

- ``store``: the append-only, sequence-numbered JSONL journal (``events.jsonl``), its writer
  and its bounded readers;
- ``follow``: the one follower of a growing JSONL file (the journal, ``steps.jsonl``),
  shared by the supervisor's books and the console;
- ``view``: the job's state folded from the journal (``JobView``);
- ``books``: the goodput books (every second booked to goodput or a named badput);
- ``status``: ``orchestrator status`` assembled from the view, the books and the step records.
"""
