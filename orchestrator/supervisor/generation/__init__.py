"""One launch of the job's ranks, from start to the outcome the template loop acts on.

- ``parts``: ``GenerationParts``, launching a generation and observing it to its outcome;
- ``judge``: ``Generation``, one launch's started and exited ranks, its outcome judged
  from what the intake queued, and its periodic judgement (calibration, stragglers);
- ``progress``: step progress of the launch's ranks;
- ``hangs``: the calibrated training timeout, and a silent or stalled rank found;
- ``stragglers``: a slow rank found and excluded;
- ``outcome``: the typed ``Outcome`` a generation ends with.
"""
