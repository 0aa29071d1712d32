"""Pure logic of the lifecycle, by concern: no Prefect, no ColossalAI, no torch.distributed.
config/ run/ storage/ data/ models/ launch/ evaluation/ hub/ tracking/ preflight/, and errors.py shared by all.
"""
