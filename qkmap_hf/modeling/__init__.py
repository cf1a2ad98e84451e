"""The files copied into checkpoints for ``trust_remote_code`` (torch and transformers imports only)."""
