"""What a process runs on: devices, the collectives under `accelerate launch`, freed memory, TRL's vLLM server mode,
model loading, the float32 master weights an engine's optimizer steps (`master_weights`, which the clients' trainers
and SCAFFOLD's correction both read), and the libraries' notices a user cannot act on (`notices`). The bottom layer,
beside `adapters`, `choices`, `names`, `sampling`."""
