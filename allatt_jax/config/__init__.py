"""What a run is told and what it tells back: the run config's schema and base, config
files and command-line flags, errors with their fix, the console."""
