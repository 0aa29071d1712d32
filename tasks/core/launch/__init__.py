"""Launching and process control: the backend registry, torchrun on this node or on Slurm, and
teardown that reaches every process of a stage.

- notice_watch.py  the ear for preemption notices (signals and pollers), a rank's and the flow process's
- proctree.py      teardown of every process of a stage; signal handlers
- shared.py        one launch for a shard stage and the training after it: started, kept, adopted or stopped
- slurm.py         Slurm's CLI client, job states and pre-flight checks
- slurm_batch.py   the Slurm batch job of one engine verb, and following it
- slurm_runner.py  the Slurm runner: one engine verb, one job, one torchrun agent per node
- torchrun.py      the torchrun command for an engine verb, run on the launch backend, output streamed
"""
