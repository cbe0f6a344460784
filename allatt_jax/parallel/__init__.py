"""The device mesh and its shardings, and joining the processes of a multi-host run."""
