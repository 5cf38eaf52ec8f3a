"""The HTTP frontend and the `lumen` command."""
