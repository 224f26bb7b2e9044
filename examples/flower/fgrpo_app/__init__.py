"""fgrpo_app: federated GRPO with trl-federated's ClientApp and ServerApp."""
