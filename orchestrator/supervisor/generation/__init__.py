"""One launch of the job's ranks, from start to the outcome the template loop acts on.

- ``parts``: ``GenerationParts``, launching a generation and observing it to its outcome;
- ``judge``: ``Generation``, one launch's started and exited ranks, and its outcome judged
  from what the intake queued;
- ``progress``: step progress and the training timeout's calibration;
- ``hangs``: a silent or stalled rank found, its stacks asked for;
- ``stragglers``: a slow rank found and excluded;
- ``outcome``: the typed ``Outcome`` a generation ends with.
"""
