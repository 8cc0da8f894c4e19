"""Training engine pieces: command-line handling, trainer, optimizer, precision, ..."""
