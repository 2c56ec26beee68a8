"""What trainstream.wrap() installs on a model (the offload engine; being built)."""
