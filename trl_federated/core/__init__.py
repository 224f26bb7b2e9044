"""The server core: `FederatedServer` (`server`), the gate every reply passes (`admission`), the round's record and
events (`round_record`, `callbacks`), the evaluation of the global adapter (`evaluation`), checkpoints (`checkpoint`)
and what a resumed run must share (`run_identity`). It imports nothing human-facing: the reports hang on its events."""
