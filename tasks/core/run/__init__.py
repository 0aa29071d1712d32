"""The run and its artifacts: stage list and run-root layout, manifests, digests, the job file, the
rank<->task line protocol and what a run keeps of itself.

- cputime.py      CPU seconds of a stage: the flow process's own and the children it waited for
- digest.py       a stage's config digest, one way for every stage
- events.py       the line protocol between the ranks and the Prefect task: emitter and parser
- handoff.py      a shared launch's hand-off file: the train job its waiting ranks run, or stop
- hostpeak.py     a process's host-memory peak over a span, from /proc
- job.py          the job file: what one engine invocation does
- manifest.py     artifact manifests, the contract between stages
- meter.py        progress of long work that is not training: done / total and an ETA, a record per interval
- preemptions.py  a run's preemptions, one record per preempted attempt, and the retry policy
- reference.py    the stage reference page and the stage list of the docs, written from the stage table
- segments.py     the layouts a training stage ran under, and the rule a new layout must keep
- stages.py       the stage list and run layout as data, and checkpoint naming
- stamp.py        verification stamps: a deep verification remembered by file identity
- tbevents.py     TensorBoard event files read back
- trainlog.py     what the console shows of a training log
"""
