"""What a process runs on: devices, the collectives under `accelerate launch`, freed memory, TRL's vLLM server mode,
model loading, and the float32 master weights an engine's optimizer steps (`master_weights`, which the clients'
trainers and SCAFFOLD's correction both read). The bottom layer, beside `adapters`, `choices`, `names`, `sampling`."""
