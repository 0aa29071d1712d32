"""The engine: what runs inside every torchrun rank, without Prefect.

    torchrun --nproc_per_node=2 -m tasks.engine train --config JOB.json    # or: shard

The Prefect task writes the job file (tasks/core/run/job.py) and reads the ranks' `@@` event lines
(tasks/core/run/events.py); nothing here imports Prefect.

- accel.py          the stage's fast kernels loaded (or fallen back from) and activation checkpointing
- agent.py          torchrun's agent as the launcher starts it: torch.distributed.run without the teardown after it
- backpressure.py   backpressure of checkpoint uploads, as every rank sees it
- boosted.py        one stage's plugin, booster, boosted model and optimizer, checkpoint save/load
- builders.py       the plugin factory: a validated PluginConfig -> a ColossalAI plugin
- checkpoint.py     training checkpoints: atomic directories, newest-complete-first resume
- cpu_compat.py     ColossalAI 0.5.0 on CPU: the patches that let its plugins run with gloo
- faults.py         fault injection for the resume tests
- handoff.py        the verb `shard-train`: shard, wait for the train stage, train in the same ranks
- hf_compat.py      ColossalAI's modeling rebuilt from its source for a newer transformers, or refused
- hostmem.py        large freed blocks handed back to the OS while a rank builds its model
- lazy_compile.py   ColossalAI imported without paying for torch's compiler
- lean_save.py      ColossalAI's sharded optimizer save with fewer copies held at once
- loop.py           the two engine verbs, `shard` and `train`
- lora.py           LoRA inside a rank: enabled before boost, saved, its base checked
- masters.py        fp32 master weights in every mixed-precision checkpoint, and their exact restore
- metrics.py        per-step metrics on rank 0: `@@progress` fields and TensorBoard files
- node_staging.py   per-node staging for an `s3://` run root on several nodes
- optim.py          the stage's optimizer and learning-rate schedule
- packing.py        packed SFT rows -> model inputs, attention kept inside each conversation
- pairs.py          a preference phase's step: pairs batched whole, the pair loss of one forward
- plan_policy.py    the derived shardformer policy: tensor parallelism from the model's own tp plan
- preconditions.py  the files a verb will read, checked before any process group exists
- rankio.py         every line a rank prints prefixed with `[rank N] `
- sampler.py        the resumable order of training rows per dp rank and step
- solo_ddp.py       HybridParallelPlugin without torch DDP where its dp group is one rank
- state_read.py     a resume's AdamW state and fp32 masters read as this rank's pieces, on threads
- weights.py        an HF folder's weights read into a sharded model one tensor at a time
"""
